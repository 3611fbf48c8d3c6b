"""Build of kvmove's compiled core, ``kvmove._C``.

Environment switches:
    UCX_HOME=<prefix>    build against a site's own UCX (e.g. one with InfiniBand verbs) instead
                         of the ``libucx-cu13`` wheel: ``<prefix>/include`` and its libraries
                         in ``lib``, ``lib64`` or ``lib/<triplet>`` (Debian: ``UCX_HOME=/usr``
                         with libucx-dev; UCX 1.13 or newer). At run time set
                         ``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true`` so the wheel's loader
                         picks the system libraries too (kvmove refuses to import when the UCX
                         loaded is older than the one it was built against).
    KVMOVE_CUDA=1        also compile ``csrc/**/*.cu`` with nvcc and link cudart statically,
                         so the module still imports on a machine with no driver.
    KVMOVE_CUDA_ARCHS    semicolon list of SM versions for nvcc (default "90"); SASS for each,
                         plus PTX for the last so newer GPUs can JIT it.
    CUDA_HOME            where the CUDA toolkit lives (default: /usr/local/cuda, else from nvcc).
    KVMOVE_SANITIZE      sanitizers to build with, e.g. "address,undefined" (gcc's ASan and
                         UBSan; -O1, frame pointers kept). The module then needs the ASan
                         runtime loaded first: ``.ci/hardening`` shows how it runs the tests.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pybind11
from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup
from setuptools.modified import newer_group

CUDA_ENABLED = os.environ.get("KVMOVE_CUDA", "0") == "1"
SANITIZE = os.environ.get("KVMOVE_SANITIZE", "").strip()

# Compile the C++ sources in parallel (all cores unless KVMOVE_BUILD_JOBS says otherwise).
ParallelCompile("KVMOVE_BUILD_JOBS").install()


def ucx_prefix() -> str:
    """Where UCX's ``include/`` and ``lib/`` live: ``UCX_HOME`` or the libucx wheel.

    The wheel's pkg-config file records the path it was built in, which does not exist here,
    so we locate the installed package instead.
    """
    if home := os.environ.get("UCX_HOME"):
        return home
    import libucx

    return os.path.dirname(libucx.__file__)


def ucx_lib_dir(prefix: str) -> str:
    """The folder holding ``libucp.so`` under a UCX prefix: ``lib``, ``lib64``, or a
    distribution's multiarch ``lib/<triplet>`` (Debian's ``UCX_HOME=/usr``)."""
    candidates = [os.path.join(prefix, "lib"), os.path.join(prefix, "lib64")]
    candidates += sorted(glob.glob(os.path.join(prefix, "lib", "*-linux-gnu")))
    for folder in candidates:
        if os.path.exists(os.path.join(folder, "libucp.so")):
            return folder
    raise RuntimeError(f"UCX_HOME={prefix!r}: no libucp.so in {candidates} (install UCX's "
                       "development files, e.g. Debian's libucx-dev)")


def cuda_home() -> str:
    """The CUDA toolkit: CUDA_HOME or CUDA_PATH, else /usr/local/cuda, else nvcc's prefix.

    nvcc on PATH may be a wrapper script, so a candidate counts only if it has the headers.
    """
    nvcc = shutil.which("nvcc")
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
                  nvcc and os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))]
    for home in filter(None, candidates):
        if os.path.isfile(os.path.join(home, "include", "cuda_runtime_api.h")):
            return home
    raise RuntimeError(f"KVMOVE_CUDA=1 but no CUDA toolkit found in {candidates}; set CUDA_HOME")


def nvcc_arch_flags() -> list[str]:
    archs = [a.strip() for a in os.environ.get("KVMOVE_CUDA_ARCHS", "90").split(";") if a.strip()]
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    return flags + [f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}"]


# Every file the module is compiled from, headers included (setuptools compares only the
# sources with the module unless told the rest).
DEPENDS = sorted(f for pattern in ("csrc/**/*", "bindings/**/*", "third_party/**/*")
                 for f in glob.glob(pattern, recursive=True) if os.path.isfile(f))


class BuildExt(build_ext):
    """pybind11's build_ext, plus nvcc for ``.cu`` sources when KVMOVE_CUDA=1.

    An up-to-date module is kept: none of ``DEPENDS`` is newer than it, and it was built with
    the same settings (``_settings``: flags, switches, compiler, UCX, pybind11, Python), as a
    stamp in the build folder records. Anything else rebuilds: setuptools alone would keep a
    CPU-only build after switching KVMOVE_CUDA on. (CI's two installs of one checkout, the
    README's, compile once.)
    """

    def build_extension(self, ext):
        stamp = self._stamp_path(ext)
        settings = self._settings(ext)
        try:
            with open(stamp) as f:
                same = f.read() == settings
        except OSError:
            same = False
        target = self.get_ext_fullpath(ext.name)
        if same and not self.force and not newer_group(ext.sources + ext.depends, target):
            self.announce(f"kvmove: {target} is up to date (sources and settings)", level=3)
            return
        self.force = True
        if os.path.exists(stamp):
            os.remove(stamp)   # an interrupted build is not trusted next time
        if CUDA_ENABLED:
            ext.extra_objects += self._compile_cuda(ext)
        super().build_extension(ext)
        os.makedirs(os.path.dirname(stamp), exist_ok=True)
        with open(stamp, "w") as f:
            f.write(settings)

    def _stamp_path(self, ext) -> str:
        """The stamp of the module this build writes (one per output path: an in-place build
        and a wheel's share the build folder)."""
        target = os.path.abspath(self.get_ext_fullpath(ext.name))
        digest = hashlib.sha256(target.encode()).hexdigest()[:16]
        return os.path.join(self.build_temp, f"kvmove-build-{digest}.json")

    def _settings(self, ext) -> str:
        """What the module is built with, as text. pip builds with pybind11 and libucx
        installed in a fresh folder each time: paths under them count by version."""
        packages = [(os.path.dirname(pybind11.__file__), f"pybind11 {pybind11.__version__}")]
        if "UCX_HOME" not in os.environ:
            import libucx

            packages.append((os.path.dirname(libucx.__file__), f"libucx {libucx.__version__}"))

        def portable(paths: list[str]) -> list[str]:
            out = []
            for path in paths:
                for root, name in packages:
                    if path == root or path.startswith(root + os.sep):
                        path = name + path[len(root):]
                out.append(path)
            return out

        return json.dumps({
            "compiler": list(getattr(self.compiler, "compiler_so", []) or []),
            "linker": list(getattr(self.compiler, "linker_so", []) or []),
            "compile_args": ext.extra_compile_args, "link_args": ext.extra_link_args,
            "macros": ext.define_macros, "libraries": ext.libraries,
            "library_dirs": portable(ext.library_dirs), "rpaths": ext.runtime_library_dirs,
            "include_dirs": portable(ext.include_dirs), "python": sys.version,
            "cuda": [cuda_home(), nvcc_arch_flags()] if CUDA_ENABLED else None,
            "env": {k: os.environ.get(k) for k in ("CC", "CXX", "CFLAGS", "CXXFLAGS",
                                                   "CPPFLAGS", "LDFLAGS")},
        }, sort_keys=True)

    def _compile_cuda(self, ext) -> list[str]:
        nvcc = os.path.join(cuda_home(), "bin", "nvcc")
        objects = []
        for source in sorted(glob.glob("csrc/**/*.cu", recursive=True)):
            obj = os.path.join(self.build_temp, source.replace("/", "_") + ".o")
            os.makedirs(os.path.dirname(obj), exist_ok=True)
            cmd = [nvcc, "-c", source, "-o", obj, "-std=c++17", "-O3", "-Xcompiler", "-fPIC",
                   "-Icsrc", *[f"-I{d}" for d in ext.include_dirs], *nvcc_arch_flags()]
            self.announce(" ".join(cmd), level=2)
            subprocess.check_call(cmd)
            objects.append(obj)
        return objects


def extension() -> Pybind11Extension:
    ucx = ucx_prefix()
    # csrc/ is organised by concern (common/, memory/, transport/, ...): every .cpp under it.
    sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    sources += sorted(glob.glob("bindings/*.cpp"))
    include_dirs = ["csrc", "third_party/xxhash", os.path.join(ucx, "include")]
    library_dirs = [ucx_lib_dir(ucx) if "UCX_HOME" in os.environ else os.path.join(ucx, "lib")]
    libraries = ["ucp", "uct", "ucs"]
    # kvmove/_C.so sits beside libucx/ in site-packages; a site UCX is found via its own lib dir.
    rpaths = ["$ORIGIN/../libucx/lib"] + ([library_dirs[0]] if "UCX_HOME" in os.environ else [])
    macros = []
    if CUDA_ENABLED:
        cuda = cuda_home()
        include_dirs.append(os.path.join(cuda, "include"))
        library_dirs += [os.path.join(cuda, "lib64"), os.path.join(cuda, "lib")]
        libraries += ["cudart_static", "dl", "rt", "pthread"]
        macros.append(("KVMOVE_WITH_CUDA", "1"))
    compile_args, link_args = ["-O3", "-Wall", "-Wextra"], []
    if SANITIZE:
        flags = [f"-fsanitize={SANITIZE}", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer",
                 "-g"]
        compile_args, link_args = ["-O1", "-Wall", "-Wextra", *flags], flags
    return Pybind11Extension(
        "kvmove._C",
        sources,
        include_dirs=include_dirs,
        library_dirs=library_dirs,
        libraries=libraries,
        runtime_library_dirs=rpaths,
        define_macros=macros,
        cxx_std=17,
        depends=DEPENDS,
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    )


setup(ext_modules=[extension()], cmdclass={"build_ext": BuildExt})
