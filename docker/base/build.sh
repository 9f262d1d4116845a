#!/usr/bin/env bash
# A stand-in for NVIDIA's Triton image (nvcr.io/nvidia/tritonserver:<yy.mm>-py3), made here from Debian's packages
# and PyPI alone, for machines that cannot pull from NGC (ours: no NVIDIA registry, no Docker Hub). Prints its tag.
#
#   bash docker/base/build.sh      # -> kestrel-triton-base:<the first 12 hex digits of this file's SHA-256>
#
# Built once: an image of that tag is reused until this recipe changes. What it keeps of NGC's conventions:
# tritonserver in /opt/tritonserver/bin (on PATH), the Python backend in /opt/tritonserver/backends/python with the
# stub of the image's python3, the working directory /opt/tritonserver, the user triton-server (uid 1000) beside
# root (the default user, as in NGC), a system pip that may install packages (PIP_BREAK_SYSTEM_PACKAGES) and numpy.
# What differs: Debian 12 (bookworm, Python 3.11) instead of Ubuntu 24.04 (Python 3.12); Triton 2.51 from the
# nvidia-pytriton 0.7.0 wheel (the NGC release our Dockerfile names carries 2.62); no CUDA, no other backends: CPU
# only. Needs root (debootstrap), Docker, and pip configured for PyPI.
set -euo pipefail
recipe="$(cd "$(dirname "$0")" && pwd)/build.sh"
tag="kestrel-triton-base:$(sha256sum "$recipe" | cut -c1-12)"
if docker image inspect "$tag" >/dev/null 2>&1; then
    echo "$tag"
    exit 0
fi
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
root="$work/root"

debootstrap --variant=minbase --include=python3,python3-pip,python3-numpy,libpython3.11,ca-certificates \
    bookworm "$root" "$mirror" > "$work/debootstrap.log" 2>&1 || { tail -20 "$work/debootstrap.log" >&2; exit 1; }

# tritonserver, its libraries and the Python backend, from the wheel, where NGC keeps them
pip download -q --no-deps --dest "$work" nvidia-pytriton==0.7.0 >&2
python3 -m zipfile -e "$work"/nvidia_pytriton-*.whl "$work/wheel"
src="$work/wheel/pytriton/tritonserver"
opt="$root/opt/tritonserver"
mkdir -p "$opt/bin" "$opt/lib" "$opt/backends/python"
install -m 755 "$src/bin/tritonserver" "$opt/bin/"
install -m 755 "$work"/wheel/nvidia_pytriton.libs/* "$opt/lib/"
install -m 755 "$src/python_backend_stubs/3.11/triton_python_backend_stub" "$opt/backends/python/"
install -m 755 "$src/backends/python/libtriton_python.so" "$opt/backends/python/"
install -m 644 "$src/backends/python/triton_python_backend_utils.py" "$opt/backends/python/"
cp -r "$src/caches" "$opt/"
# the backend and its stub look for the libraries beside the wheel's folder; here the loader's path finds them
echo /opt/tritonserver/lib > "$root/etc/ld.so.conf.d/tritonserver.conf"
chroot "$root" ldconfig
chroot "$root" useradd --uid 1000 --create-home --shell /bin/bash triton-server
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* "$root"/usr/share/man/*

tar -C "$root" -c . | docker import \
    --change 'ENV PATH=/opt/tritonserver/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV PIP_BREAK_SYSTEM_PACKAGES=1' \
    --change 'WORKDIR /opt/tritonserver' \
    --change 'CMD ["/bin/bash"]' - "$tag" >&2
echo "$tag"
