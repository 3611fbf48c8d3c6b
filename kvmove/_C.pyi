# Type stubs of kvmove._C, the private compiled core. Regenerate after changing bindings/:
#   pybind11-stubgen kvmove._C -o <dir>  (then copy <dir>/kvmove/_C.pyi here)
# tests/test_package.py checks that they name exactly what the module has.
"""
kvmove's compiled core. Private: import kvmove instead.
"""
from __future__ import annotations
import collections.abc
import numpy
import numpy.typing
import typing
__all__: list[str] = ['Agent', 'BlockFile', 'BlockOrder', 'BlockPool', 'BlockShape', 'DType', 'KVCache', 'LoadStream', 'Offer', 'Region', 'SaveStream', 'StreamState', 'StreamStats', 'Transfer', 'TransferState', 'TransferStats', 'block_hashes', 'check_timeout', 'convert_blocks', 'copy_blocks', 'cuda_status', 'decode_metadata', 'decode_stream_message', 'encode_stream_message', 'hash_ids', 'log_dropped', 'pack_blocks', 'parse_order', 'peer_error_settings', 'runs', 'set_log_level', 'take_log', 'ucx_version', 'unpack_blocks', 'xxh64']
class BlockPool:
    """
    Fixed pool of ``num_blocks`` equal blocks with ids ``0..num_blocks-1``: reference counts,
    contiguity-aware allocation and a prefix cache keyed by block hashes. Owns no memory (see
    ``KVCache``). Thread-safe: every call holds the pool's lock and releases the GIL.
    
    A block is *free* (ref 0), *cached* (ref 0, carries a hash: evictable, revived by ``match``)
    or *used* (ref > 0). ``num_free`` counts free and cached blocks.
    """
    def __init__(self, num_blocks: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def allocate(self, n: typing.SupportsInt | typing.SupportsIndex) -> list[int] | None:
        """
        ``n`` blocks with reference count 1, in as few runs of consecutive ids as possible; ``None``
        when fewer than ``n`` are free right now (back-pressure). All-or-nothing. Evicts least
        recently used cached blocks when free ones are not enough.
        
        Raises:
            ConfigError: ``n < 1`` or ``n > num_blocks``.
        """
    def block_hash(self, id: typing.SupportsInt | typing.SupportsIndex) -> int | None:
        """
        The hash committed to block ``id``, or None.
        """
    def commit(self, ids: list[int], hashes: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> None:
        """
        Tags used blocks with content hashes (``block_hashes``) so that, once freed, they stay cached
        and ``match`` can find them. A hash already held by another block is left to that block.
        
        Raises:
            ConfigError: ``len(ids) != len(hashes)``.
            BlockError: an id out of range, not allocated, or already tagged with another hash.
        """
    def free(self, ids: list[int]) -> None:
        """
        Drops one reference per occurrence of each id. At zero a block with a hash becomes cached
        (LRU, the list's last block evicted first), one without returns to the free runs.
        
        Raises:
            BlockError: an id out of range, a free block, or more frees than references.
        """
    def match(self, hashes: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> list[int]:
        """
        Ids of the longest cached prefix of ``hashes``, each with one new reference (the caller frees them like allocated blocks).
        """
    def ref_count(self, id: typing.SupportsInt | typing.SupportsIndex) -> int:
        ...
    def share(self, ids: list[int]) -> None:
        """
        Adds one reference per occurrence of each id. Raises BlockError for a block that is not allocated.
        """
    @property
    def num_blocks(self) -> int:
        ...
    @property
    def num_cached(self) -> int:
        """
        Freed blocks that carry a hash, kept until evicted.
        """
    @property
    def num_free(self) -> int:
        """
        Free plus cached (evictable) blocks.
        """
    @property
    def num_used(self) -> int:
        ...
class DType:
    """
    Members:
    
      float32
    
      float16
    
      bfloat16
    
      float8
    """
    __members__: typing.ClassVar[dict[str, DType]]
    bfloat16: typing.ClassVar[DType]
    float16: typing.ClassVar[DType]
    float32: typing.ClassVar[DType]
    float8: typing.ClassVar[DType]
    @typing.overload
    def __eq__(self, other: DType) -> bool:
        ...
    @typing.overload
    def __eq__(self, other: typing.Any) -> bool:
        ...
    def __getstate__(self) -> int:
        ...
    def __hash__(self) -> int:
        ...
    def __index__(self) -> int:
        ...
    def __init__(self, value: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __int__(self) -> int:
        ...
    @typing.overload
    def __ne__(self, other: DType) -> bool:
        ...
    @typing.overload
    def __ne__(self, other: typing.Any) -> bool:
        ...
    def __repr__(self) -> str:
        ...
    def __setstate__(self, state: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __str__(self) -> str:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def value(self) -> int:
        ...
class BlockOrder:
    """
    The element order inside a block.
    
    Members:
    
      NHD
    
      HND
    
      VLLM_CPU
    
      MLA
    """
    HND: typing.ClassVar[BlockOrder]
    MLA: typing.ClassVar[BlockOrder]
    NHD: typing.ClassVar[BlockOrder]
    VLLM_CPU: typing.ClassVar[BlockOrder]
    __members__: typing.ClassVar[dict[str, BlockOrder]]
    @typing.overload
    def __eq__(self, other: BlockOrder) -> bool:
        ...
    @typing.overload
    def __eq__(self, other: typing.Any) -> bool:
        ...
    def __getstate__(self) -> int:
        ...
    def __hash__(self) -> int:
        ...
    def __index__(self) -> int:
        ...
    def __init__(self, value: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __int__(self) -> int:
        ...
    @typing.overload
    def __ne__(self, other: BlockOrder) -> bool:
        ...
    @typing.overload
    def __ne__(self, other: typing.Any) -> bool:
        ...
    def __repr__(self) -> str:
        ...
    def __setstate__(self, state: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __str__(self) -> str:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def value(self) -> int:
        ...
class BlockShape:
    """
    What one block of one layer holds (common/block_shape.h).
    """
    def __init__(self, block_size: typing.SupportsInt | typing.SupportsIndex, num_kv_heads: typing.SupportsInt | typing.SupportsIndex, head_dim: typing.SupportsInt | typing.SupportsIndex, dtype: DType, order: BlockOrder = ..., head_first: typing.SupportsInt | typing.SupportsIndex = 0, total_kv_heads: typing.SupportsInt | typing.SupportsIndex | None = None) -> None:
        """
        total_kv_heads: the model's KV heads (default num_kv_heads: no tensor-parallel split); the block holds [head_first, head_first + num_kv_heads) of them.
        """
    @property
    def block_size(self) -> int:
        ...
    @property
    def dtype(self) -> DType:
        ...
    @property
    def head_dim(self) -> int:
        ...
    @property
    def head_first(self) -> int:
        ...
    @property
    def nbytes(self) -> int:
        """
        Bytes of one block of one layer.
        """
    @property
    def num_kv_heads(self) -> int:
        ...
    @property
    def order(self) -> BlockOrder:
        ...
    @property
    def total_kv_heads(self) -> int:
        ...
class Region:
    """
    Host or device memory with one owner. A host region exposes its bytes zero-copy through the
    buffer protocol (``numpy.frombuffer(region, numpy.uint8)`` is a writable view, not a copy); a
    device cache through ``kvmove.KVCache.__cuda_array_interface__``.
    """
    def __init__(self, nbytes: typing.SupportsInt | typing.SupportsIndex, huge_pages: bool = False, device: typing.SupportsInt | typing.SupportsIndex = -1, pin: bool = False) -> None:
        ...
    @property
    def addr(self) -> int:
        ...
    @property
    def device(self) -> int:
        """
        CUDA device, or -1 for host memory.
        """
    @property
    def huge_pages(self) -> bool:
        ...
    @property
    def nbytes(self) -> int:
        ...
    @property
    def pinned(self) -> bool:
        """
        Host memory page-locked for DMA (cudaHostRegister).
        """
class KVCache:
    """
    Untyped core of kvmove.KVCache (layers x blocks x bytes).
    """
    @typing.overload
    def __init__(self, num_layers: typing.SupportsInt | typing.SupportsIndex, num_blocks: typing.SupportsInt | typing.SupportsIndex, block_nbytes: typing.SupportsInt | typing.SupportsIndex, huge_pages: bool = False, device: typing.SupportsInt | typing.SupportsIndex = -1, pin: bool = False) -> None:
        ...
    @typing.overload
    def __init__(self, num_layers: typing.SupportsInt | typing.SupportsIndex, num_blocks: typing.SupportsInt | typing.SupportsIndex, num_parts: typing.SupportsInt | typing.SupportsIndex, planes: collections.abc.Sequence[tuple[typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex]], segments: collections.abc.Sequence[tuple[int, int]], device: typing.SupportsInt | typing.SupportsIndex) -> None:
        """
        Wraps memory owned elsewhere: planes (base, block_stride, block_nbytes, segment), layer-major, inside segments (addr, nbytes). The caller keeps the memory alive.
        """
    def descriptors(self, block_ids: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], layers: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] | None = None) -> list[tuple[int, int]]:
        ...
    def offset(self, layer: typing.SupportsInt | typing.SupportsIndex, block: typing.SupportsInt | typing.SupportsIndex) -> int:
        """
        Byte offset of (layer, block) from the region's start.
        """
    @property
    def block_nbytes(self) -> int:
        """
        Bytes of one block in one layer (K and V).
        """
    @property
    def device(self) -> int:
        """
        CUDA device, or -1 for host memory.
        """
    @property
    def num_blocks(self) -> int:
        ...
    @property
    def num_layers(self) -> int:
        ...
    @property
    def num_parts(self) -> int:
        ...
    @property
    def planes(self) -> list[tuple[int, int, int, int]]:
        """
        (base, block_stride, block_nbytes, segment) of each plane.
        """
    @property
    def pool(self) -> BlockPool:
        ...
    @property
    def region(self) -> Region:
        """
        The owned region; None when wrapped.
        """
    @property
    def segments(self) -> list[tuple[int, int]]:
        """
        (addr, nbytes) of each span registered with a transport.
        """
    @property
    def wrapped(self) -> bool:
        ...
class BlockFile:
    """
    KV blocks in fixed-size, 4 KiB-aligned slots of one file, each with an XXH64 checksum seeded by
    its content hash. The bytes of a disk storage tier; kvmove.store keeps the index.
    """
    SLOT_ALIGN: typing.ClassVar[int] = 4096
    def __init__(self, path: str, block_nbytes: typing.SupportsInt | typing.SupportsIndex, num_slots: typing.SupportsInt | typing.SupportsIndex, direct: bool = True) -> None:
        ...
    def close(self) -> None:
        ...
    def read(self, cache: KVCache, block_ids: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], slots: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], hashes: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], checksums: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> list[int]:
        """
        Reads slots into blocks up to the first bad checksum; 1 (read) or 0 per block.
        """
    def sync(self) -> None:
        ...
    def write(self, cache: KVCache, block_ids: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], slots: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], hashes: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> list[int]:
        """
        Writes blocks into slots; returns their checksums. StoreError on an I/O error.
        """
    @property
    def block_nbytes(self) -> int:
        ...
    @property
    def direct(self) -> bool:
        ...
    @property
    def num_slots(self) -> int:
        ...
    @property
    def path(self) -> str:
        ...
    @property
    def slot_nbytes(self) -> int:
        ...
class Offer:
    def __init__(self, peer: str, request_id: str, epoch: typing.SupportsInt | typing.SupportsIndex, block_ids: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> None:
        ...
    @property
    def block_ids(self) -> list[int]:
        ...
    @property
    def epoch(self) -> int:
        ...
    @property
    def peer(self) -> str:
        ...
    @property
    def request_id(self) -> str:
        ...
class StreamState:
    """
    Members:
    
      OPEN
    
      DONE
    
      ABORTED
    
      FAILED
    """
    ABORTED: typing.ClassVar[StreamState]
    DONE: typing.ClassVar[StreamState]
    FAILED: typing.ClassVar[StreamState]
    OPEN: typing.ClassVar[StreamState]
    __members__: typing.ClassVar[dict[str, StreamState]]
    @typing.overload
    def __eq__(self, other: StreamState) -> bool:
        ...
    @typing.overload
    def __eq__(self, other: typing.Any) -> bool:
        ...
    def __getstate__(self) -> int:
        ...
    def __hash__(self) -> int:
        ...
    def __index__(self) -> int:
        ...
    def __init__(self, value: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __int__(self) -> int:
        ...
    @typing.overload
    def __ne__(self, other: StreamState) -> bool:
        ...
    @typing.overload
    def __ne__(self, other: typing.Any) -> bool:
        ...
    def __repr__(self) -> str:
        ...
    def __setstate__(self, state: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __str__(self) -> str:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def value(self) -> int:
        ...
class SaveStream:
    def abort(self) -> None:
        ...
    def finish(self, payload: bytes) -> None:
        ...
    def layer_times(self) -> list:
        ...
    def save_layer(self, layer: typing.SupportsInt | typing.SupportsIndex, cuda_event: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def wait(self, timeout: typing.SupportsFloat | typing.SupportsIndex) -> StreamState:
        ...
    @property
    def answered(self) -> bool:
        ...
    @property
    def checksums(self) -> bool:
        ...
    @property
    def epoch(self) -> int:
        ...
    @property
    def error(self) -> str:
        ...
    @property
    def num_blocks(self) -> int:
        ...
    @property
    def num_layers(self) -> int:
        ...
    @property
    def peer(self) -> str:
        ...
    @property
    def request_id(self) -> str:
        ...
    @property
    def state(self) -> StreamState:
        ...
class LoadStream:
    def bad_blocks(self) -> list[int]:
        ...
    def cancel(self) -> None:
        ...
    def layer_times(self) -> list:
        ...
    def layers_ready(self) -> list[bool]:
        ...
    def start_load(self) -> None:
        ...
    def wait_all(self, timeout: typing.SupportsFloat | typing.SupportsIndex) -> bytes:
        ...
    def wait_for_layer(self, layer: typing.SupportsInt | typing.SupportsIndex, timeout: typing.SupportsFloat | typing.SupportsIndex) -> None:
        ...
    def wait_released(self, timeout: typing.SupportsFloat | typing.SupportsIndex) -> bool:
        ...
    @property
    def epoch(self) -> int:
        ...
    @property
    def error(self) -> str:
        ...
    @property
    def local_ids(self) -> list[int]:
        ...
    @property
    def num_layers(self) -> int:
        ...
    @property
    def payload(self) -> bytes:
        ...
    @property
    def peer(self) -> str:
        ...
    @property
    def released(self) -> bool:
        ...
    @property
    def request_id(self) -> str:
        ...
    @property
    def state(self) -> StreamState:
        ...
class TransferState:
    """
    Members:
    
      PENDING
    
      DONE
    
      FAILED
    """
    DONE: typing.ClassVar[TransferState]
    FAILED: typing.ClassVar[TransferState]
    PENDING: typing.ClassVar[TransferState]
    __members__: typing.ClassVar[dict[str, TransferState]]
    @typing.overload
    def __eq__(self, other: TransferState) -> bool:
        ...
    @typing.overload
    def __eq__(self, other: typing.Any) -> bool:
        ...
    def __getstate__(self) -> int:
        ...
    def __hash__(self) -> int:
        ...
    def __index__(self) -> int:
        ...
    def __init__(self, value: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __int__(self) -> int:
        ...
    @typing.overload
    def __ne__(self, other: TransferState) -> bool:
        ...
    @typing.overload
    def __ne__(self, other: typing.Any) -> bool:
        ...
    def __repr__(self) -> str:
        ...
    def __setstate__(self, state: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __str__(self) -> str:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def value(self) -> int:
        ...
class TransferStats:
    def __repr__(self) -> str:
        ...
    @property
    def complete_seconds(self) -> float:
        ...
    @property
    def nbytes(self) -> int:
        ...
    @property
    def num_ops(self) -> int:
        """
        RMA operations posted (coalesced).
        """
    @property
    def post_seconds(self) -> float:
        ...
class Transfer:
    def wait(self, timeout: typing.SupportsFloat | typing.SupportsIndex) -> None:
        ...
    @property
    def error(self) -> str:
        ...
    @property
    def peer(self) -> str:
        ...
    @property
    def state(self) -> TransferState:
        ...
    @property
    def stats(self) -> TransferStats:
        ...
class StreamStats:
    @property
    def acks_missed(self) -> int:
        ...
    @property
    def begins_refused(self) -> int:
        ...
    @property
    def blocks_quarantined(self) -> int:
        ...
    @property
    def cancels_sent(self) -> int:
        ...
    @property
    def checksum_mismatches(self) -> int:
        ...
    @property
    def leases_active(self) -> int:
        ...
    @property
    def leases_expired(self) -> int:
        ...
    @property
    def leases_granted(self) -> int:
        ...
    @property
    def messages_dropped(self) -> int:
        ...
    @property
    def messages_refused(self) -> int:
        ...
    @property
    def senders_disconnected(self) -> int:
        ...
    @property
    def unknown_senders(self) -> int:
        ...
class Agent:
    def __init__(self, name: str, cache: KVCache, shape: BlockShape, transports: str, peer_errors: bool, peer_timeout: typing.SupportsFloat | typing.SupportsIndex, cancel_timeout: typing.SupportsFloat | typing.SupportsIndex, ack_timeout: typing.SupportsFloat | typing.SupportsIndex, faults: str, net_devices: str, max_peers: typing.SupportsInt | typing.SupportsIndex, map_same_host: bool = True, copy_threads: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        ...
    def _send_raw_stream_message(self, peer: str, message: bytes) -> None:
        ...
    def add_peer(self, metadata: str, rejoin: bool = False) -> str:
        ...
    def close(self) -> None:
        ...
    def decline(self, offer: Offer, reason: str) -> None:
        ...
    def expect(self, peer: str, request_id: str, local_ids: list[int], lease_seconds: typing.SupportsFloat | typing.SupportsIndex) -> LoadStream:
        ...
    def fault_counts(self) -> dict[str, int]:
        ...
    def metadata(self) -> bytes:
        ...
    def notifications(self) -> list:
        ...
    def notify(self, peer: str, payload: bytes) -> Transfer:
        ...
    def offer(self, peer: str, request_id: str, local_ids: list[int], lease_seconds: typing.SupportsFloat | typing.SupportsIndex) -> LoadStream:
        ...
    def offer_nothing(self, peer: str, request_id: str) -> None:
        ...
    def offers(self) -> list[Offer]:
        ...
    def peer_path(self, name: str) -> str:
        """
        How transfers with the peer move: 'mapped' (same host) or 'ucx'.
        """
    def peer_transports(self, name: str) -> list[tuple[str, str]]:
        ...
    def read(self, peer: str, local_ids: list[int], remote_ids: list[int], layers: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] | None = None, notify: str | None = None) -> Transfer:
        """
        One-sided get of remote_ids[i] -> local_ids[i] (see docs/transfer.md).
        """
    def remove_peer(self, name: str) -> None:
        ...
    def stream_stats(self) -> StreamStats:
        ...
    def stream_to(self, peer: str, local_ids: list[int], remote_ids: list[int], request_id: str, epoch: typing.SupportsInt | typing.SupportsIndex, checksums: bool) -> SaveStream:
        ...
    def wait_notification(self, timeout: typing.SupportsFloat | typing.SupportsIndex) -> tuple:
        ...
    def wait_offer(self, timeout: typing.SupportsFloat | typing.SupportsIndex) -> Offer:
        ...
    def write(self, peer: str, local_ids: list[int], remote_ids: list[int], layers: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] | None = None, notify: str | None = None) -> Transfer:
        """
        One-sided put of local_ids[i] -> remote_ids[i] (see docs/transfer.md).
        """
    @property
    def closed(self) -> bool:
        ...
    @property
    def incarnation(self) -> int:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def peers(self) -> list[str]:
        ...
def block_hashes(token_ids: typing.Annotated[numpy.typing.ArrayLike, numpy.int64], block_size: typing.SupportsInt | typing.SupportsIndex, parent: typing.SupportsInt | typing.SupportsIndex | None = None, seed: typing.SupportsInt | typing.SupportsIndex = 0) -> list[int]:
    """
    Chained 64-bit content hashes of the full blocks of ``token_ids`` (a trailing partial block
    gets none): block i's hash is XXH64 of its parent's hash and its tokens (as little-endian
    int64), so equal hashes mean equal prefixes. ``parent`` continues a chain from an earlier
    block's hash. Pass the result to ``BlockPool.commit`` / ``BlockPool.match``.
    
    Args:
        token_ids: ``[num_tokens]`` integer ids (list or array; converted to int64).
        block_size: tokens per block.
        parent: hash of the block before ``token_ids[0]``, or None at the start of a sequence.
        seed: XXH64's seed (0: the plain chain; a secret one for keyed hashes).
    """
def check_timeout(timeout: typing.SupportsFloat | typing.SupportsIndex) -> None:
    """
    Raises ConfigError unless timeout is in [0, 1e6] seconds (every wait's rule).
    """
def convert_blocks(src: KVCache, src_shape: BlockShape, src_ids: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], dst: KVCache, dst_shape: BlockShape, dst_ids: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], num_tokens: typing.SupportsInt | typing.SupportsIndex, layers: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], scales_addr: typing.SupportsInt | typing.SupportsIndex, scales_nbytes: typing.SupportsInt | typing.SupportsIndex) -> None:
    """
    Copies num_tokens tokens between caches of other block sizes, head orders, dtypes.
    """
def copy_blocks(src: KVCache, src_ids: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], dst: KVCache, dst_ids: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> None:
    """
    Copies blocks (every layer) between two caches of the same shape.
    """
def cuda_status() -> tuple[bool, int, str]:
    """
    (built with CUDA, device count, reason when 0).
    """
def decode_metadata(data: bytes) -> dict:
    """
    Decodes unsigned agent metadata (the core's wire format); raises MetadataError naming the field that is wrong.
    """
def decode_stream_message(data: bytes) -> dict:
    """
    Decodes a stream message as an agent does when it arrives; raises MetadataError naming what is wrong.
    """
def encode_stream_message(kind: str, request_id: str, epoch: typing.SupportsInt | typing.SupportsIndex, layer: typing.SupportsInt | typing.SupportsIndex = 0, ids_hash: typing.SupportsInt | typing.SupportsIndex = 0, checksums: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] = [], payload: bytes = b'', block_ids: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] = []) -> bytes:
    """
    A stream message's bytes (kind: 'Begin', 'Go', 'Layer'...), as a peer sends them.
    """
def hash_ids(ids: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> int:
    ...
def log_dropped() -> int:
    """
    Core log records dropped on a full queue.
    """
def pack_blocks(cache: KVCache, block_ids: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], layers: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], staging_addr: typing.SupportsInt | typing.SupportsIndex, staging_nbytes: typing.SupportsInt | typing.SupportsIndex) -> None:
    """
    Copies blocks of layers into a contiguous [layers, blocks, block_nbytes] buffer.
    """
def parse_order(name: str) -> BlockOrder | None:
    """
    The BlockOrder named ``name`` ("NHD", "vllm-cpu"...), or None.
    """
def peer_error_settings() -> list[tuple[str, str]]:
    """
    (key without UCX_, value) pairs an agent adds to UCX's config in PEER error mode.
    """
def runs(ids: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> list[tuple[int, int]]:
    """
    Consecutive ascending ids as ``(first, count)`` runs, in order: ``[4, 5, 6, 9, 2, 3] -> [(4, 3), (9, 1), (2, 2)]``.
    """
def set_log_level(level: typing.SupportsInt | typing.SupportsIndex) -> None:
    """
    The core's records below this logging level are dropped where they are made.
    """
def take_log(max_records: typing.SupportsInt | typing.SupportsIndex = 1000) -> list:
    """
    (level, logger, message) records the core queued.
    """
def ucx_version() -> str:
    """
    Version of the libucp this process loaded.
    """
def unpack_blocks(staging_addr: typing.SupportsInt | typing.SupportsIndex, staging_nbytes: typing.SupportsInt | typing.SupportsIndex, cache: KVCache, block_ids: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], layers: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> None:
    """
    The reverse of pack_blocks.
    """
def xxh64(data: bytes, seed: typing.SupportsInt | typing.SupportsIndex = 0) -> int:
    """
    XXH64 of ``data`` (the hash block_hashes uses).
    """
