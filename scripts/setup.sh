#!/usr/bin/env bash
# Installs everything moecore's CPU build and tests need on Debian 12 (idempotent: packages
# already present are not reinstalled). The CUDA toolkit, when wanted, is installed separately.
set -euo pipefail

packages=(g++ cmake ninja-build ccache libopenblas-dev libtomlplusplus-dev
          nlohmann-json3-dev libgtest-dev openmpi-bin libopenmpi-dev)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "setup: all packages present"
fi
