#!/usr/bin/env bash
# Runs the engine's TLS tests and an mTLS pull through two agents with kernel TLS records on
# Debian's Linux 6.1 (its tls.ko) in QEMU: no machine here has a kernel with CONFIG_TLS built in.
# Needs qemu-system-x86 and busybox-static (apt). Slow without KVM (TCG): a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
kver=6.1.0-47-amd64
work=${KTLS_WORK:-target/ktls}
rm -rf "$work" && mkdir -p "$work/root"/{bin,sbin,proc,sys,dev,tmp,lib64,lib/x86_64-linux-gnu}
(cd "$work" && apt-get download "linux-image-$kver-unsigned" && dpkg -x linux-image-*.deb k)
cargo build --release -p kvfabric-cli --bin kvfabric
tests=$(cargo test --release -p kvfabric-engine --lib --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys; print([j["executable"] for j in map(json.loads, sys.stdin) if j.get("executable")][0])')
r=$work/root
cp /bin/busybox "$r/bin/"
for a in sh mount modprobe ip cat grep head; do ln -sf busybox "$r/bin/$a"; done
ln -sf ../bin/busybox "$r/sbin/modprobe"
objcopy --strip-debug "$tests" "$r/bin/engine-tests"
objcopy --strip-debug target/release/kvfabric "$r/bin/kvfabric"
ldd "$r/bin/engine-tests" "$r/bin/kvfabric" | awk '/=>/ {print $3}' | sort -u |
  xargs -I{} cp -L {} "$r/lib/x86_64-linux-gnu/"
cp -L /lib64/ld-linux-x86-64.so.2 "$r/lib64/"
m=$work/k/lib/modules/$kver
for d in crypto arch/x86/crypto net/tls lib; do
  mkdir -p "$r/lib/modules/$kver/kernel/$d" && cp -r "$m/kernel/$d/." "$r/lib/modules/$kver/kernel/$d/"
done
cp "$m"/modules.* "$r/lib/modules/$kver/" && busybox depmod -b "$r" "$kver"
cat > "$r/init" <<'INIT'
#!/bin/sh
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
mkdir -p /dev/shm; mount -t tmpfs tmp /tmp; mount -t tmpfs shm /dev/shm
ip link set lo up; modprobe tls && modprobe gcm && echo "kernel $(cat /proc/sys/kernel/osrelease): tls loaded"
export HOME=/tmp TMPDIR=/tmp
/bin/engine-tests --test-threads 2 data_stream kernel_tls tls_record 2>&1 | grep -E "^test |test result|panicked|flip"
for op in read write; do
  /bin/kvfabric bench --through-agent --tls --tls-kernel-records true --op $op --block-size 1MiB \
    --blocks-per-batch 16 --pool-bytes 64MiB --duration 1 2>&1 | grep -oE "records sealed[^;]*|verified: [0-9]+ [KMG]iB"
done
poweroff -f
INIT
chmod +x "$r/init"
(cd "$r" && find . | busybox cpio -o -H newc 2>/dev/null | gzip -1 > ../initrd.gz)
accel=tcg; [ -w /dev/kvm ] && [ "${KTLS_KVM:-0}" = 1 ] && accel=kvm
timeout 600 qemu-system-x86_64 -accel $accel -cpu max -m 3G -smp 2 -kernel "$work/k/boot/vmlinuz-$kver" \
  -initrd "$work/initrd.gz" -append "console=ttyS0 panic=-1 quiet" -nographic -no-reboot |
  sed 's/\x1b\[[0-9;?]*[a-zA-Z]//g' | grep -a -E "kernel |^test |test result|panicked|flip|sealed|verified"
