// What the loaded UCX offers this process: every transport resource of every memory domain of
// every component, as `ucx_info -d` lists them. Asking loads UCX's transport modules (the
// libuct_*.so a build was configured with), so it also says which of them load here.
#include <dlfcn.h>
#include <uct/api/uct.h>

#include <memory>
#include <string>
#include <vector>

#include "transport/ucx.h"

namespace kvmove {

namespace {

const char* device_type_name(uct_device_type_t type) {
    switch (type) {
        case UCT_DEVICE_TYPE_NET:
            return "net";
        case UCT_DEVICE_TYPE_SHM:
            return "shm";
        case UCT_DEVICE_TYPE_ACC:
            return "acc";
        case UCT_DEVICE_TYPE_SELF:
            return "self";
        default:
            return "other";
    }
}

struct MdConfigDeleter {
    void operator()(uct_md_config_t* c) const { uct_config_release(c); }
};
struct MdDeleter {
    void operator()(uct_md_h md) const { uct_md_close(md); }
};

// The transport resources of one memory domain; none when it cannot be opened here (a module
// whose driver or device is missing), which is what the caller wants to learn.
void add_resources(uct_component_h component, const std::string& component_name,
                   const char* md_name, std::vector<UcxResource>& out) {
    uct_md_config_t* raw_config = nullptr;
    if (uct_md_config_read(component, nullptr, nullptr, &raw_config) != UCS_OK) {
        return;
    }
    std::unique_ptr<uct_md_config_t, MdConfigDeleter> config(raw_config);
    uct_md_h raw_md = nullptr;
    if (uct_md_open(component, md_name, config.get(), &raw_md) != UCS_OK) {
        return;
    }
    std::unique_ptr<std::remove_pointer_t<uct_md_h>, MdDeleter> md(raw_md);
    uct_tl_resource_desc_t* resources = nullptr;
    unsigned count = 0;
    if (uct_md_query_tl_resources(md.get(), &resources, &count) != UCS_OK) {
        return;
    }
    for (unsigned i = 0; i < count; ++i) {
        out.push_back({component_name, md_name, resources[i].tl_name, resources[i].dev_name,
                       device_type_name(resources[i].dev_type)});
    }
    uct_release_tl_resource_list(resources);
}

}  // namespace

std::string ucx_library() {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&ucp_get_version_string), &info) == 0 ||
        info.dli_fname == nullptr) {
        return "";
    }
    return info.dli_fname;
}

std::vector<UcxResource> ucx_resources() {
    uct_component_h* components = nullptr;
    unsigned num_components = 0;
    KVMOVE_UCX_CHECK(uct_query_components(&components, &num_components),
                     "cannot list UCX's components");
    std::vector<UcxResource> out;
    for (unsigned c = 0; c < num_components; ++c) {
        uct_component_attr_t attr{};
        attr.field_mask =
            UCT_COMPONENT_ATTR_FIELD_NAME | UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT;
        if (uct_component_query(components[c], &attr) != UCS_OK) {
            continue;
        }
        std::vector<uct_md_resource_desc_t> mds(attr.md_resource_count);
        attr.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
        attr.md_resources = mds.data();
        if (uct_component_query(components[c], &attr) != UCS_OK) {
            continue;
        }
        for (const uct_md_resource_desc_t& md : mds) {
            add_resources(components[c], attr.name, md.md_name, out);
        }
    }
    uct_release_component_list(components);
    return out;
}

}  // namespace kvmove
