# syntax=docker/dockerfile:1
# kvmesh container image: one `kvmesh` binary (router, engine, bench, ...) on a slim Debian runtime.
#
#   docker build -t kvmesh:dev .
#   docker run --rm kvmesh:dev --help
#
# Not built in this repository's CI (no container daemon there): it is checked by reading, against
# what the build needs (the workspace manifests, Cargo.lock, crates/ and configs/: the router and the
# bench embed configs/router.yaml and configs/arms/*.yaml with include_str!, so the binary carries
# the default placement and every bench arm; no crate has a build script) and what the binary links
# (glibc, libm, libgcc_s only: `ldd target/release/kvmesh`). See docs/deploy.md.

# The toolchain the repository is built and tested with (rustc 1.95); Cargo.toml's rust-version
# (1.90) is the minimum.
ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm

FROM rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS builder
WORKDIR /src
# The rust image carries gcc/g++: the tokenizers dependency compiles a little C++ and ring (TLS of
# the router's Kubernetes client) some C and assembly, both with `cc`; nothing needs cmake or clang.
COPY Cargo.toml Cargo.lock ./
COPY crates ./crates
COPY configs ./configs
# --locked: the image gets exactly the dependency versions CI tested. The cache mounts keep the
# registry and target dir between builds (BuildKit); the binary is copied out of the cached target
# dir in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p kvmesh \
 && install -D -m 0755 target/release/kvmesh /out/kvmesh

FROM debian:${DEBIAN_RELEASE}-slim AS runtime
# The binary links only glibc, libm and libgcc_s, which the slim image has. The one TLS client is the
# router's Kubernetes API client (`discovery: {kind: kubernetes}`; rustls, linked statically): in a
# pod it trusts the service account's CA, but with a kubeconfig that names no CA it reads the
# system's roots, hence ca-certificates. Engines and the router speak plain HTTP to each other.
# Not pinned (hadolint DL3008): ca-certificates should follow Debian's updates, not freeze.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 kvmesh \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin kvmesh
COPY --from=builder /out/kvmesh /usr/local/bin/kvmesh
# Model cache for `--backend model` (KVMESH_CACHE_DIR): mount model files or a volume here. The
# image has no Python, so `kvmesh model fetch` (which runs pip) does not work inside it.
ENV KVMESH_CACHE_DIR=/var/cache/kvmesh
RUN install -d -o 10001 -g 10001 /var/cache/kvmesh
USER 10001:10001
# 8000: HTTP (router or engine, --port); 7100: engine P2P producer (--p2p-port);
# 5557: engine KV events (the --kv-events-config endpoint). None is bound unless configured;
# router and engine listen on 127.0.0.1 by default: pass --host 0.0.0.0 in a container.
EXPOSE 8000 7100 5557
ENTRYPOINT ["/usr/local/bin/kvmesh"]
CMD ["--help"]
