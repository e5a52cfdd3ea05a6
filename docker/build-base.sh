#!/usr/bin/env bash
# docker/build-base.sh [--rebuild]
#
# Builds a local base image for docker/Dockerfile on a machine that has a Docker
# engine but no registry: debootstrap a minimal Debian with python3, python3-venv
# and ca-certificates from the Debian package archive, then `docker import` it.
# Prints the tag; pass it on:
#
#   docker build -f docker/Dockerfile --target server \
#       --build-arg BASE_IMAGE=tfps-base:bookworm -t tfps-server .
#
# Re-runnable: when the tag already exists it only says so; --rebuild builds it
# again from scratch. The root filesystem is assembled in docker/.build/rootfs and
# deleted once imported (the classic builder would send it with the build context);
# an interrupted run leaves it behind and the next run starts it over.
#
# Certificates: the CA certificates the host added locally (*.crt under
# /usr/local/share/ca-certificates, e.g. an HTTPS proxy's) are trusted in the image
# too, and PIP_CERT points pip at the system bundle, so `pip install` inside
# `docker build` reaches the package index wherever the host does.
#
# Needs root (debootstrap creates device nodes and chroots). Settings, from the
# environment:
#   TFPS_BASE_IMAGE  tag to create          (default tfps-base:bookworm)
#   DEBIAN_SUITE     Debian release         (default bookworm: python3 is 3.11)
#   DEBIAN_MIRROR    package archive        (default http://deb.debian.org/debian)
#   EXTRA_CA_DIR     host CAs to trust      (default /usr/local/share/ca-certificates;
#                                            empty: none)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
tag="${TFPS_BASE_IMAGE:-tfps-base:bookworm}"
suite="${DEBIAN_SUITE:-bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
build="$here/.build"
rootfs="$build/rootfs"
extra_ca_dir="${EXTRA_CA_DIR-/usr/local/share/ca-certificates}"
packages="python3,python3-venv,ca-certificates"

rebuild=0
case "${1:-}" in
    "") ;;
    --rebuild) rebuild=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-base.sh: unknown argument: $1 (try --help)" >&2; exit 2 ;;
esac

command -v docker >/dev/null || { echo "build-base.sh: docker not found" >&2; exit 1; }

if [ "$rebuild" -eq 0 ] && docker image inspect "$tag" >/dev/null 2>&1; then
    echo "== $tag exists (pass --rebuild to build it again)"
    echo "$tag"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "build-base.sh: debootstrap needs root; run it as root (or with sudo)" >&2
    exit 1
fi

start=$SECONDS
mkdir -p "$build"

if ! command -v debootstrap >/dev/null; then
    echo "== installing debootstrap"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi

rm -rf "$rootfs"   # left by an interrupted run: never trusted
echo "== debootstrap $suite ($packages) from $mirror"
t0=$SECONDS
# minbase: essential packages and apt only; python3 pulls what it needs.
debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror"
if [ -n "$extra_ca_dir" ] && compgen -G "$extra_ca_dir/*.crt" >/dev/null; then
    echo "== trusting the host's CAs in $extra_ca_dir"
    cp "$extra_ca_dir"/*.crt "$rootfs/usr/local/share/ca-certificates/"
    chroot "$rootfs" update-ca-certificates
fi
# The image never runs apt on its own; drop the downloaded .debs and indexes.
chroot "$rootfs" apt-get clean
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/log/* "$rootfs"/tmp/*
# Check what the Dockerfile relies on here, rather than in a failed build.
chroot "$rootfs" python3 -c 'import ensurepip, ssl, venv, sys; print("python", sys.version.split()[0])'
chroot "$rootfs" sh -c 'command -v useradd >/dev/null' \
    || { echo "build-base.sh: useradd missing from the root filesystem" >&2; exit 1; }
echo "== debootstrap took $((SECONDS - t0)) s"

echo "== docker import -> $tag"
t0=$SECONDS
# /dev, /proc and /sys are provided by the container runtime, not the image.
tar -C "$rootfs" --numeric-owner \
    --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' -c . \
  | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
        --change 'CMD ["python3"]' \
        --message "debootstrap $suite minbase + $packages" \
        - "$tag" >/dev/null
rm -rf "$rootfs"
echo "== docker import took $((SECONDS - t0)) s"

docker image ls "$tag"
echo "== done in $((SECONDS - start)) s"
echo "$tag"
