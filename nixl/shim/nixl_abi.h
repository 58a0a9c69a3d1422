// The part of NIXL's backend plugin ABI (plugin API version 1, as in the `nixl` 1.5.1 wheel)
// this plugin touches, declared here because no registry this project builds from carries
// NIXL's headers. Layouts and the order of virtual methods are NIXL's; `abi_check` in
// plugin.cpp pins the sizes, and the Python tests load the plugin into the real wheel and move
// bytes through it, so a drift fails there.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

enum nixl_mem_t { DRAM_SEG, VRAM_SEG, BLK_SEG, OBJ_SEG, FILE_SEG };
enum nixl_xfer_op_t { NIXL_READ, NIXL_WRITE };
enum nixl_status_t {
    NIXL_IN_PROG = 1,
    NIXL_SUCCESS = 0,
    NIXL_ERR_NOT_POSTED = -1,
    NIXL_ERR_INVALID_PARAM = -2,
    NIXL_ERR_BACKEND = -3,
    NIXL_ERR_NOT_FOUND = -4,
    NIXL_ERR_MISMATCH = -5,
    NIXL_ERR_NOT_ALLOWED = -6,
    NIXL_ERR_REPOST_ACTIVE = -7,
    NIXL_ERR_UNKNOWN = -8,
    NIXL_ERR_NOT_SUPPORTED = -9,
    NIXL_ERR_REMOTE_DISCONNECT = -10,
    NIXL_ERR_CANCELED = -11,
    NIXL_ERR_NO_TELEMETRY = -12
};
enum class nixl_thread_sync_t { NONE, STRICT, RW };

using nixl_b_params_t = std::unordered_map<std::string, std::string>;
using nixl_mem_list_t = std::vector<nixl_mem_t>;
using notif_list_t = std::vector<std::pair<std::string, std::string>>;

// NIXL's descriptor classes have no virtual methods: plain layouts.
struct nixlBasicDesc {
    uintptr_t addr;
    size_t len;
    uint64_t devId;
};
struct nixlBlobDesc : nixlBasicDesc {
    std::string metaInfo;
};

class nixlBackendMD {
protected:
    bool isPrivateMD;

public:
    explicit nixlBackendMD(bool is_private) : isPrivateMD(is_private) {}
    virtual ~nixlBackendMD() {}
};

struct nixlMetaDesc : nixlBasicDesc {
    nixlBackendMD *metadataP;
};

// nixlDescList<nixlMetaDesc>: a polymorphic class (its vtable pointer first), the memory type,
// then the descriptors. Only ever read here, through NIXL's object.
struct nixlMetaDescList {
    const void *vptr;
    nixl_mem_t type;
    std::vector<nixlMetaDesc> descs;
};

class nixlBackendReqH {
public:
    nixlBackendReqH() {}
    virtual ~nixlBackendReqH() {}
};

struct nixlBackendOptionalArgs {
    std::string notifMsg;
    bool hasNotif = false;
    std::string customParam;
};

class nixlBackendInitParams {
public:
    std::string localAgent;
    std::string type;
    nixl_b_params_t *customParams = nullptr;
    bool enableProgTh = false;
    uint64_t pthrDelay = 0;
    nixl_thread_sync_t syncMode;
    bool enableTelemetry_ = false;
};

// The base class NIXL's core calls through. Data members in NIXL's order (the core reads
// `initErr` inline); virtual methods in NIXL's order, the ones this plugin does not implement
// answering as NIXL's defaults do.
class nixlBackendEngine {
private:
    std::string backendType;
    nixl_b_params_t customParams;
    std::vector<std::pair<int, uint64_t>> telemetryEvents_; // nixlTelemetryEvent: never touched here
    std::mutex telemetryEventsMutex_;

protected:
    bool initErr = false;
    const std::string localAgent;
    const bool enableTelemetry_;

public:
    explicit nixlBackendEngine(const nixlBackendInitParams *init)
        : backendType(init->type),
          customParams(init->customParams ? *init->customParams : nixl_b_params_t{}),
          localAgent(init->localAgent),
          enableTelemetry_(init->enableTelemetry_) {}
    nixlBackendEngine(const nixlBackendEngine &) = delete;
    void operator=(const nixlBackendEngine &) = delete;
    virtual ~nixlBackendEngine() = default;

    const nixl_b_params_t &params() const { return customParams; }

    virtual bool supportsRemote() const = 0;
    virtual bool supportsLocal() const = 0;
    virtual bool supportsNotif() const = 0;
    virtual nixl_mem_list_t getSupportedMems() const = 0;
    virtual nixl_status_t
    registerMem(const nixlBlobDesc &mem, const nixl_mem_t &nixl_mem, nixlBackendMD *&out) = 0;
    virtual nixl_status_t deregisterMem(nixlBackendMD *meta) = 0;
    virtual nixl_status_t connect(const std::string &remote_agent) = 0;
    virtual nixl_status_t disconnect(const std::string &remote_agent) = 0;
    virtual nixl_status_t unloadMD(nixlBackendMD *input) = 0;
    virtual nixl_status_t prepXfer(const nixl_xfer_op_t &operation,
                                   const nixlMetaDescList &local,
                                   const nixlMetaDescList &remote,
                                   const std::string &remote_agent,
                                   nixlBackendReqH *&handle,
                                   const nixlBackendOptionalArgs *opt_args) const = 0;
    virtual nixl_status_t postXfer(const nixl_xfer_op_t &operation,
                                   const nixlMetaDescList &local,
                                   const nixlMetaDescList &remote,
                                   const std::string &remote_agent,
                                   nixlBackendReqH *&handle,
                                   const nixlBackendOptionalArgs *opt_args) const = 0;
    virtual nixl_status_t checkXfer(nixlBackendReqH *handle) const = 0;
    virtual nixl_status_t releaseReqH(nixlBackendReqH *handle) const = 0;
    // prepMemView for remote, then for local descriptor lists; releaseMemView.
    virtual nixl_status_t prepMemView(const void *, void *&, const nixlBackendOptionalArgs *) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual nixl_status_t
    prepMemView(const nixlMetaDescList &, void *&, const nixlBackendOptionalArgs *) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual void releaseMemView(void *) const {}
    virtual nixl_status_t getPublicData(const nixlBackendMD *meta, std::string &str) const = 0;
    virtual nixl_status_t getConnInfo(std::string &str) const = 0;
    virtual nixl_status_t
    loadRemoteConnInfo(const std::string &remote_agent, const std::string &remote_conn_info) = 0;
    virtual nixl_status_t loadRemoteMD(const nixlBlobDesc &input,
                                       const nixl_mem_t &nixl_mem,
                                       const std::string &remote_agent,
                                       nixlBackendMD *&output) = 0;
    virtual nixl_status_t loadLocalMD(nixlBackendMD *, nixlBackendMD *&) {
        return NIXL_ERR_BACKEND;
    }
    virtual nixl_status_t getNotifs(notif_list_t &notif_list) = 0;
    virtual nixl_status_t genNotif(const std::string &remote_agent, const std::string &msg) const = 0;
    // queryMem(descs, responses) and estimateXferCost(9 arguments): not offered.
    virtual nixl_status_t queryMem(const void *, void *) const { return NIXL_ERR_NOT_SUPPORTED; }
    virtual nixl_status_t estimateXferCost(const void *,
                                           const void *,
                                           const void *,
                                           const void *,
                                           const void *,
                                           void *,
                                           void *,
                                           void *,
                                           const void *) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
};

#define NIXL_PLUGIN_API_VERSION 1

struct nixlBackendPlugin {
    int api_version;
    nixlBackendEngine *(*create_engine)(const nixlBackendInitParams *init_params);
    void (*destroy_engine)(nixlBackendEngine *engine);
    const char *(*get_plugin_name)();
    const char *(*get_plugin_version)();
    nixl_b_params_t (*get_backend_options)();
    nixl_mem_list_t (*get_backend_mems)();
};
