# syntax=docker/dockerfile:1
# The operator and agent images for builders with a container daemon (docker buildx, podman,
# kaniko). scripts/build-images.sh builds the same images without one (mmdebstrap + umoci) and
# checks them; the two share the package lists, paths, user and entrypoints below.
#
#   docker build --target operator -t ghcr.io/kvfabric/kvfabric-operator:0.1.0 .
#   docker build --target agent    -t ghcr.io/kvfabric/kvfabric-agent:0.1.0 .

ARG VERSION=0.1.0

FROM rust:1.95-bookworm AS build
# protoc for etcd-client's and the agent's protobufs; cmake, libclang, pkg-config and the
# libnl/verbs headers for the rdma feature's rdma-core bindings.
RUN apt-get update \
    && apt-get install -y --no-install-recommends protobuf-compiler cmake clang libclang-dev \
        pkg-config libnl-3-dev libnl-route-3-dev libibverbs-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p kvfabric-operator --bins \
    && cargo build --release --locked -p kvfabric-cli --no-default-features --features rdma,cuda --bin kvfabric \
    && mkdir -p /out \
    && for b in kvfabric-operator kvfabric-socket-dir kvfabric; do \
         objcopy --strip-debug target/release/$b /out/$b; \
       done

# Minimal root filesystems: the listed Debian packages extracted, nothing else (no shell, no
# package manager), and the users.
FROM debian:bookworm AS rootfs
RUN apt-get update && mkdir -p /debs/operator /debs/agent \
    && cd /debs/operator && apt-get download libc6 libgcc-s1 gcc-12-base \
    && cd /debs/agent && apt-get download libc6 libgcc-s1 gcc-12-base libibverbs1 \
        ibverbs-providers libnl-3-200 libnl-route-3-200 \
    && for image in operator agent; do \
         mkdir -p /rootfs/$image/tmp /rootfs/$image/etc; \
         for d in /debs/$image/*.deb; do dpkg-deb -x "$d" /rootfs/$image; done; \
         rm -rf /rootfs/$image/usr/share/doc /rootfs/$image/usr/share/man /rootfs/$image/usr/share/locale; \
         chmod 1777 /rootfs/$image/tmp; \
         printf 'root:x:0:0:root:/root:/usr/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/usr/sbin/nologin\n' > /rootfs/$image/etc/passwd; \
         printf 'root:x:0:\nnonroot:x:65532:\n' > /rootfs/$image/etc/group; \
         printf 'passwd: files\ngroup: files\nhosts: files dns\n' > /rootfs/$image/etc/nsswitch.conf; \
       done

FROM scratch AS operator
ARG VERSION
COPY --from=rootfs /rootfs/operator/ /
COPY --from=build /out/kvfabric-operator /usr/local/bin/kvfabric-operator
USER 65532:65532
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
LABEL org.opencontainers.image.title="kvfabric-operator" \
      org.opencontainers.image.description="kvfabric operator: runs kvfabric agents for TransferFabric resources" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/kvfabric/kvfabric" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="debian:bookworm"
ENTRYPOINT ["/usr/local/bin/kvfabric-operator"]

# The agent runs as 65532 without capabilities; with RDMA the operator runs it as uid 0 with
# IPC_LOCK only (memory registration beyond RLIMIT_MEMLOCK; added capabilities reach uid 0 only).
FROM scratch AS agent
ARG VERSION
COPY --from=rootfs /rootfs/agent/ /
COPY --from=build /out/kvfabric /usr/local/bin/kvfabric
COPY --from=build /out/kvfabric-socket-dir /usr/local/bin/kvfabric-socket-dir
USER 65532:65532
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
LABEL org.opencontainers.image.title="kvfabric-agent" \
      org.opencontainers.image.description="kvfabric node agent (rdma, cuda-ipc, shm, tcp) and the socket directory helper" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/kvfabric/kvfabric" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="debian:bookworm"
ENTRYPOINT ["/usr/local/bin/kvfabric"]
CMD ["agent"]
