// The class NIXL instantiates for backend "KVFABRIC": every method forwards to the Rust side
// (src/ffi.rs) over a C ABI, and nothing else lives here. Exceptions never cross into NIXL's
// core or into Rust.
#include "nixl_abi.h"

#include <cstdio>
#include <cstdlib>
#include <new>

extern "C" {
struct KvfDesc {
    uint64_t addr;
    uint64_t len;
    uint64_t dev;
    void *md;
};
struct KvfStr {
    const char *ptr;
    size_t len;
};
typedef void (*kvf_push_notif)(void *ctx, const char *from, size_t from_len, const char *msg, size_t msg_len);

void *kvf_backend_new(const char *agent, size_t agent_len, const char *dir, size_t dir_len);
void kvf_backend_free(void *backend);
KvfStr kvf_conn_info(const void *backend);
int kvf_register(void *backend, uint64_t addr, uint64_t len, uint64_t dev, int mem, void **out);
int kvf_deregister(void *backend, void *md);
KvfStr kvf_public_data(const void *md);
int kvf_load_remote_conn(void *backend, const char *agent, size_t agent_len, const char *info, size_t info_len);
int kvf_disconnect(void *backend, const char *agent, size_t agent_len);
int kvf_load_remote_md(void *backend,
                       uint64_t addr,
                       uint64_t len,
                       uint64_t dev,
                       const char *meta,
                       size_t meta_len,
                       int mem,
                       const char *agent,
                       size_t agent_len,
                       void **out);
void kvf_unload_md(void *md);
int kvf_prep(const void *backend,
             int op,
             const KvfDesc *local,
             size_t local_len,
             const KvfDesc *remote,
             size_t remote_len,
             const char *agent,
             size_t agent_len,
             void **out);
int kvf_post(const void *backend, void *req, const char *notif, size_t notif_len, int has_notif);
int kvf_check(void *req);
int kvf_release(void *req);
int kvf_take_notifs(void *backend, void *ctx, kvf_push_notif push);
int kvf_gen_notif(const void *backend, const char *agent, size_t agent_len, const char *msg, size_t msg_len);
}

namespace {

static_assert(sizeof(nixlBasicDesc) == 24);
static_assert(sizeof(nixlMetaDesc) == 32);
static_assert(sizeof(nixlMetaDescList) == 40);
static_assert(sizeof(nixlBackendInitParams) == 96);
static_assert(sizeof(nixlBackendOptionalArgs) == 72);
// NIXL reads initErr at 0xa0 of its engine object; this layout puts it there.
static_assert(sizeof(nixlBackendEngine) == 0xd0);

// Registered (local) or loaded (remote) memory: the Rust side's record of it.
struct KvfMD : nixlBackendMD {
    void *rust;
    explicit KvfMD(void *r) : nixlBackendMD(true), rust(r) {}
};

struct KvfReq : nixlBackendReqH {
    void *rust;
    explicit KvfReq(void *r) : rust(r) {}
};

template <typename F> nixl_status_t guarded(F f) {
    try {
        return f();
    }
    catch (const std::bad_alloc &) {
        std::fprintf(stderr, "kvfabric-nixl: out of memory\n");
        return NIXL_ERR_BACKEND;
    }
    catch (...) {
        std::fprintf(stderr, "kvfabric-nixl: unexpected C++ exception\n");
        return NIXL_ERR_UNKNOWN;
    }
}

std::vector<KvfDesc> descs_of(const nixlMetaDescList &list) {
    std::vector<KvfDesc> out;
    out.reserve(list.descs.size());
    for (const nixlMetaDesc &d : list.descs) {
        auto *md = static_cast<KvfMD *>(d.metadataP);
        out.push_back(KvfDesc{d.addr, d.len, d.devId, md ? md->rust : nullptr});
    }
    return out;
}

class KvfEngine : public nixlBackendEngine {
    void *rust = nullptr;

public:
    explicit KvfEngine(const nixlBackendInitParams *init) : nixlBackendEngine(init) {
        // The agent's socket directory: the backend parameter, else KVFABRIC_SOCKET_DIR, else
        // the Helm chart's host path (the Rust side decides).
        std::string dir;
        auto it = params().find("socket_dir");
        if (it != params().end()) dir = it->second;
        rust = kvf_backend_new(localAgent.data(), localAgent.size(), dir.data(), dir.size());
        initErr = rust == nullptr;
    }
    ~KvfEngine() override {
        if (rust) kvf_backend_free(rust);
    }

    bool supportsRemote() const override { return true; }
    bool supportsLocal() const override { return false; }
    bool supportsNotif() const override { return true; }
    nixl_mem_list_t getSupportedMems() const override { return {DRAM_SEG, VRAM_SEG}; }

    nixl_status_t
    registerMem(const nixlBlobDesc &mem, const nixl_mem_t &nixl_mem, nixlBackendMD *&out) override {
        return guarded([&] {
            void *md = nullptr;
            int rc = kvf_register(rust, mem.addr, mem.len, mem.devId, nixl_mem, &md);
            if (rc == NIXL_SUCCESS) out = new KvfMD(md);
            return nixl_status_t(rc);
        });
    }
    nixl_status_t deregisterMem(nixlBackendMD *meta) override {
        auto *md = static_cast<KvfMD *>(meta);
        int rc = kvf_deregister(rust, md->rust);
        delete md;
        return nixl_status_t(rc);
    }
    nixl_status_t connect(const std::string &) override {
        // Agents connect on the first batch; nothing to set up per peer here.
        return NIXL_SUCCESS;
    }
    nixl_status_t disconnect(const std::string &remote_agent) override {
        return nixl_status_t(kvf_disconnect(rust, remote_agent.data(), remote_agent.size()));
    }
    nixl_status_t unloadMD(nixlBackendMD *input) override {
        auto *md = static_cast<KvfMD *>(input);
        kvf_unload_md(md->rust);
        delete md;
        return NIXL_SUCCESS;
    }
    nixl_status_t prepXfer(const nixl_xfer_op_t &operation,
                           const nixlMetaDescList &local,
                           const nixlMetaDescList &remote,
                           const std::string &remote_agent,
                           nixlBackendReqH *&handle,
                           const nixlBackendOptionalArgs *) const override {
        return guarded([&] {
            handle = nullptr;
            std::vector<KvfDesc> l = descs_of(local), r = descs_of(remote);
            void *req = nullptr;
            int rc = kvf_prep(rust, operation, l.data(), l.size(), r.data(), r.size(),
                              remote_agent.data(), remote_agent.size(), &req);
            if (rc == NIXL_SUCCESS) handle = new KvfReq(req);
            return nixl_status_t(rc);
        });
    }
    nixl_status_t postXfer(const nixl_xfer_op_t &,
                           const nixlMetaDescList &,
                           const nixlMetaDescList &,
                           const std::string &,
                           nixlBackendReqH *&handle,
                           const nixlBackendOptionalArgs *opt) const override {
        // The batches were planned by prepXfer from the same lists (NIXL posts what it
        // prepared); a notification, if asked for, follows the data.
        auto *req = static_cast<KvfReq *>(handle);
        if (!req) return NIXL_ERR_NOT_POSTED;
        bool has = opt && opt->hasNotif;
        return nixl_status_t(kvf_post(rust, req->rust, has ? opt->notifMsg.data() : nullptr,
                                      has ? opt->notifMsg.size() : 0, has));
    }
    nixl_status_t checkXfer(nixlBackendReqH *handle) const override {
        return nixl_status_t(kvf_check(static_cast<KvfReq *>(handle)->rust));
    }
    nixl_status_t releaseReqH(nixlBackendReqH *handle) const override {
        auto *req = static_cast<KvfReq *>(handle);
        int rc = kvf_release(req->rust);
        // Refused while its batches run (NIXL keeps the handle and says so to its caller).
        if (rc == NIXL_SUCCESS) delete req;
        return nixl_status_t(rc);
    }
    nixl_status_t getPublicData(const nixlBackendMD *meta, std::string &str) const override {
        return guarded([&] {
            KvfStr s = kvf_public_data(static_cast<const KvfMD *>(meta)->rust);
            str.assign(s.ptr, s.len);
            return NIXL_SUCCESS;
        });
    }
    nixl_status_t getConnInfo(std::string &str) const override {
        return guarded([&] {
            KvfStr s = kvf_conn_info(rust);
            str.assign(s.ptr, s.len);
            return NIXL_SUCCESS;
        });
    }
    nixl_status_t loadRemoteConnInfo(const std::string &remote_agent,
                                     const std::string &info) override {
        return nixl_status_t(kvf_load_remote_conn(rust, remote_agent.data(), remote_agent.size(),
                                                  info.data(), info.size()));
    }
    nixl_status_t loadRemoteMD(const nixlBlobDesc &input,
                               const nixl_mem_t &nixl_mem,
                               const std::string &remote_agent,
                               nixlBackendMD *&output) override {
        return guarded([&] {
            void *md = nullptr;
            int rc = kvf_load_remote_md(rust, input.addr, input.len, input.devId,
                                        input.metaInfo.data(), input.metaInfo.size(), nixl_mem,
                                        remote_agent.data(), remote_agent.size(), &md);
            if (rc == NIXL_SUCCESS) output = new KvfMD(md);
            return nixl_status_t(rc);
        });
    }
    nixl_status_t getNotifs(notif_list_t &list) override {
        return guarded([&] {
            // Called from Rust: no exception may leave it.
            auto push = [](void *ctx, const char *from, size_t from_len, const char *msg,
                           size_t msg_len) {
                try {
                    static_cast<notif_list_t *>(ctx)->emplace_back(std::string(from, from_len),
                                                                   std::string(msg, msg_len));
                }
                catch (...) {
                    std::fprintf(stderr, "kvfabric-nixl: a notification was dropped (no memory)\n");
                }
            };
            return nixl_status_t(kvf_take_notifs(rust, &list, push));
        });
    }
    nixl_status_t genNotif(const std::string &remote_agent, const std::string &msg) const override {
        return nixl_status_t(
            kvf_gen_notif(rust, remote_agent.data(), remote_agent.size(), msg.data(), msg.size()));
    }
};

nixlBackendEngine *create_engine(const nixlBackendInitParams *init) {
    try {
        return new KvfEngine(init);
    }
    catch (...) {
        std::fprintf(stderr, "kvfabric-nixl: could not create the engine\n");
        return nullptr;
    }
}

void destroy_engine(nixlBackendEngine *engine) {
    delete engine;
}

const char *plugin_name() {
    return "KVFABRIC";
}

const char *plugin_version() {
    return KVF_VERSION;
}

nixl_b_params_t backend_options() {
    return {{"socket_dir", ""}};
}

nixl_mem_list_t backend_mems() {
    return {DRAM_SEG, VRAM_SEG};
}

nixlBackendPlugin plugin = {NIXL_PLUGIN_API_VERSION,
                            create_engine,
                            destroy_engine,
                            plugin_name,
                            plugin_version,
                            backend_options,
                            backend_mems};

} // namespace

// Exported by the Rust side's nixl_plugin_init (a cdylib exports only Rust's symbols).
extern "C" nixlBackendPlugin *kvf_shim_plugin() {
    return &plugin;
}
