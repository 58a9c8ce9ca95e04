#!/usr/bin/env bash
# Installs the Debian packages strata builds and tests with. Idempotent: does nothing
# when every package is present. Needs root (or sudo) only when something is missing.
set -euo pipefail

PACKAGES=(
  build-essential cmake make pkg-config python3
  nlohmann-json3-dev          # JSON loaders
  libfmt-dev                  # table formatting
  libgtest-dev libgmock-dev   # unit tests
  libbenchmark-dev            # Google Benchmark binaries
  libeigen3-dev               # CPU executor GEMMs
  libopenmpi-dev openmpi-bin  # CPU executor communicator, profile links
  clang-16 libclang-rt-16-dev # make test's ASan + UBSan build (compiles faster than g++; Makefile SAN_CXX)
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
