#!/usr/bin/env bash
# Installs everything moecore's CPU build and tests need on Debian 12 (idempotent: packages
# already present are not reinstalled). The CUDA toolkit, when wanted, is installed separately.
# Where nvcc exists, also fetches the header-only cuDNN frontend (the pinned PyPI wheel
# nvidia-cudnn-frontend, downloaded with pip, never installed) into .deps/cudnn_frontend/include
# for the cuDNN attention backend; skipped when that version is already there. A failed fetch is
# reported and setup goes on (the CUDA build then has the own attention kernels only).
set -euo pipefail

cd "$(dirname "$0")/.."

packages=(g++ cmake ninja-build ccache libopenblas-dev libtomlplusplus-dev
          nlohmann-json3-dev libgtest-dev openmpi-bin libopenmpi-dev python3
          pkg-config libpcre2-dev libicu-dev zlib1g-dev)

SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
apt_updated=0
apt_install() {  # packages...
  if [ "$apt_updated" -eq 0 ]; then
    $SUDO apt-get update -qq
    apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  apt_install "${missing[@]}"
else
  echo "setup: all packages present"
fi

# ---- Chromium (the headless check of the report and plan pages only) -------------------------
# A large package (about 100 MB installed with its libraries), so a failure here is reported and
# setup goes on: the entry report.browser then reports skipped, never passed.
if command -v chromium >/dev/null || command -v chromium-browser >/dev/null || command -v google-chrome >/dev/null; then
  echo "setup: chromium present"
else
  echo "setup: installing chromium (for the headless check of the HTML pages)"
  apt_install chromium ||
    echo "setup: WARNING: apt-get install chromium failed: the report.browser test will be skipped" >&2
fi

# ---- Python `tokenizers` (the tokenizer golden test and bench only) ---------------------------
# A pinned wheel (abi3, so it fits Python 3.11 x86_64) installed with --target into .deps/py, which
# git ignores; the system Python is left alone. Without it the golden test reports skipped.
tok_version=0.22.1
tok_dir=.deps/py
tok_present() {
  [ -f "$tok_dir/tokenizers-$tok_version.dist-info/METADATA" ]
}
if tok_present; then
  echo "setup: Python tokenizers $tok_version present in $tok_dir"
else
  if ! python3 -m pip --version >/dev/null 2>&1; then
    echo "setup: installing python3-pip (for the tokenizers wheel)"
    apt_install python3-pip || echo "setup: WARNING: apt-get install python3-pip failed" >&2
  fi
  echo "setup: installing tokenizers==$tok_version into $tok_dir"
  rm -rf "$tok_dir"/tokenizers "$tok_dir"/tokenizers-*.dist-info
  python3 -m pip install --target "$tok_dir" --only-binary=:all: --no-deps --disable-pip-version-check \
      --quiet "tokenizers==$tok_version" ||
    echo "setup: WARNING: could not install tokenizers $tok_version: the tokenizer golden test will be skipped" >&2
fi

# ---- cuDNN frontend headers (CUDA builds only) -------------------------------------------------
# The wheel's include/ holds cudnn_frontend*.h and its third-party headers; nothing else of it
# is used. The file is pinned by version and by its SHA-256.
fe_version=1.16.0
fe_wheel=nvidia_cudnn_frontend-1.16.0-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
fe_sha256=5c4a8fc573d85a86e08b15d9bf37f729e2487298781867a492a59cde6ac295e2
fe_dir=.deps/cudnn_frontend
fe_header="$fe_dir/include/cudnn_frontend_version.h"

fe_present() {
  [ -f "$fe_header" ] &&
    grep -q "CUDNN_FRONTEND_MAJOR_VERSION ${fe_version%%.*}\$" "$fe_header" &&
    grep -q "CUDNN_FRONTEND_MINOR_VERSION $(echo "$fe_version" | cut -d. -f2)\$" "$fe_header" &&
    grep -q "CUDNN_FRONTEND_PATCH_VERSION ${fe_version##*.}\$" "$fe_header"
}

fe_fail() {  # message: setup goes on without the frontend (the build then omits the cuDNN backend)
  echo "setup: WARNING: could not fetch the cuDNN frontend $fe_version: $*" >&2
  echo "setup: the CUDA build will have the own attention kernels only (no cuDNN backend). To add it," >&2
  echo "setup: rerun where PyPI is reachable, or copy $fe_dir/include from such a machine." >&2
  return 1
}

fetch_frontend() {
  if ! python3 -m pip --version >/dev/null 2>&1; then
    echo "setup: installing python3-pip (to download the cuDNN frontend wheel)"
    apt_install python3-pip || { fe_fail "apt-get install python3-pip failed"; return 1; }
  fi
  local tmp got
  tmp=$(mktemp -d)
  trap 'rm -rf "'"$tmp"'"' EXIT
  echo "setup: downloading nvidia-cudnn-frontend==$fe_version (headers only are kept)"
  # A fixed wheel whatever the local Python: the headers are the same in every wheel.
  python3 -m pip download "nvidia-cudnn-frontend==$fe_version" --no-deps --only-binary=:all: \
      --python-version 3.11 --implementation cp --abi cp311 --platform manylinux_2_28_x86_64 \
      --disable-pip-version-check --quiet -d "$tmp" ||
    { fe_fail "pip download failed (is PyPI reachable?)"; return 1; }
  [ -f "$tmp/$fe_wheel" ] || { fe_fail "pip did not produce $fe_wheel (got: $(ls "$tmp"))"; return 1; }
  got=$(sha256sum "$tmp/$fe_wheel" | cut -d' ' -f1)
  [ "$got" = "$fe_sha256" ] || { fe_fail "$fe_wheel has SHA-256 $got, expected $fe_sha256"; return 1; }
  python3 - "$tmp/$fe_wheel" "$tmp/unpacked" <<'EOF_PY' || { fe_fail "unpacking include/ from the wheel failed"; return 1; }
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    names = [n for n in z.namelist() if n.startswith("include/")]
    if "include/cudnn_frontend.h" not in names:
        sys.exit("the wheel has no include/cudnn_frontend.h")
    z.extractall(sys.argv[2], names)
EOF_PY
  # Replace any other version whole.
  rm -rf "$fe_dir"
  mkdir -p "$fe_dir"
  mv "$tmp/unpacked/include" "$fe_dir/include"
  fe_present || { fe_fail "$fe_header does not name version $fe_version"; return 1; }
  echo "setup: cuDNN frontend $fe_version in $fe_dir/include"
}

if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: no nvcc: skipping the cuDNN frontend (CUDA builds only)"
elif fe_present; then
  echo "setup: cuDNN frontend $fe_version present in $fe_dir"
else
  fetch_frontend || true
fi

# ---- NVSHMEM (CUDA builds only: the rowwise expert exchange) -----------------------------------
# The pinned wheel nvidia-nvshmem-cu13 (the GPU host's 3.4.5); only include/, the host library and
# the unique-id bootstrap are kept, in .deps/nvshmem (ignored by git). The build without it works
# and says so; a GPU host whose Python has the same wheel installed is found there by CMake.
nv_version=3.4.5
nv_wheel=nvidia_nvshmem_cu13-3.4.5-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl
nv_sha256=290f0a2ee94c9f3687a02502f3b9299a9f9fe826e6d0287ee18482e78d495b80
nv_dir=.deps/nvshmem
nv_stamp="$nv_dir/VERSION"

nv_fail() {
  echo "setup: WARNING: could not fetch NVSHMEM $nv_version: $*" >&2
  echo "setup: the CUDA build goes on without NVSHMEM (the rowwise exchange's GPU transport is left out)." >&2
  return 1
}

fetch_nvshmem() {
  python3 -m pip --version >/dev/null 2>&1 || apt_install python3-pip || { nv_fail "no pip"; return 1; }
  local tmp got
  tmp=$(mktemp -d)
  echo "setup: downloading nvidia-nvshmem-cu13==$nv_version (headers, host library, unique-id bootstrap)"
  python3 -m pip download "nvidia-nvshmem-cu13==$nv_version" --no-deps --only-binary=:all: \
      --platform manylinux2014_x86_64 --disable-pip-version-check --quiet -d "$tmp" ||
    { rm -rf "$tmp"; nv_fail "pip download failed (is PyPI reachable?)"; return 1; }
  [ -f "$tmp/$nv_wheel" ] || { rm -rf "$tmp"; nv_fail "pip did not produce $nv_wheel"; return 1; }
  got=$(sha256sum "$tmp/$nv_wheel" | cut -d' ' -f1)
  [ "$got" = "$nv_sha256" ] || { rm -rf "$tmp"; nv_fail "$nv_wheel has SHA-256 $got, expected $nv_sha256"; return 1; }
  python3 - "$tmp/$nv_wheel" "$tmp/unpacked" <<'EOF_PY' || { rm -rf "$tmp"; nv_fail "unpacking the wheel failed"; return 1; }
import sys, zipfile
keep = ("nvidia/nvshmem/include/", "nvidia/nvshmem/lib/libnvshmem_host.so.3",
        "nvidia/nvshmem/lib/nvshmem_bootstrap_uid.so.3")
with zipfile.ZipFile(sys.argv[1]) as z:
    names = [n for n in z.namelist() if n.startswith(keep)]
    if "nvidia/nvshmem/include/nvshmem_host.h" not in names:
        sys.exit("the wheel has no nvidia/nvshmem/include/nvshmem_host.h")
    z.extractall(sys.argv[2], names)
EOF_PY
  rm -rf "$nv_dir"
  mkdir -p "$nv_dir"
  mv "$tmp/unpacked/nvidia/nvshmem/include" "$nv_dir/include"
  mv "$tmp/unpacked/nvidia/nvshmem/lib" "$nv_dir/lib"
  echo "$nv_version" >"$nv_stamp"
  rm -rf "$tmp"
  echo "setup: NVSHMEM $nv_version in $nv_dir"
}

if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: no nvcc: skipping NVSHMEM (CUDA builds only)"
elif [ -f "$nv_stamp" ] && [ "$(cat "$nv_stamp")" = "$nv_version" ]; then
  echo "setup: NVSHMEM $nv_version present in $nv_dir"
else
  fetch_nvshmem || true
fi
