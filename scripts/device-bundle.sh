#!/usr/bin/env bash
# Prepares, on THIS machine, everything scripts/device-check.sh needs on the device machine.
# The device machine has CUDA 13 (nvcc, cuBLAS) and the GPU but none of the Debian packages
# strata builds and runs with (Open MPI, fmt, Eigen, ...) and no network, so it cannot run
# install-deps or build there. This machine has the packages and nvcc but no GPU. So:
#   1. build the sm_90 Release binaries here (strata, cuda_ops_test, cuda_bench);
#   2. copy every shared library they, mpirun/orted and Open MPI's and PMIx's plugins load,
#      apart from glibc's, the C++ runtime's and CUDA's (the device has newer or the same);
#   3. copy the Open MPI and PMIx plugin and help trees, relocated at run time through
#      OPAL_PREFIX and PMIX_INSTALL_PREFIX (bundle env.sh sets them, with Debian's MCA
#      settings as environment variables since /etc/openmpi does not travel).
# Output: .device-bundle/ (git-ignored), carried to the device with `run`'s carry; there
#   source .device-bundle/env.sh && STRATA_BUNDLE=.device-bundle scripts/device-check.sh $OUT
# Check here with: scripts/device-bundle.sh --self-test (runs 1 and 2 CPU ranks from the
# bundle with the system's Open MPI and PMIx trees hidden: run it only while nothing else on
# this machine, CI included, needs MPI).
#   usage: scripts/device-bundle.sh [--self-test]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=$ROOT/.device-bundle
B=$ROOT/build-device
ARCH_LIB=/usr/lib/x86_64-linux-gnu

if [ "${1:-}" != "--self-test" ]; then
  bash scripts/install-deps.sh > /dev/null
  cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > /dev/null
  # A failed build stops here: binaries an earlier build left in $B must not be bundled.
  if ! cmake --build "$B" -j 2 --target strata cuda_ops_test cuda_bench > "$B/build.log" 2>&1; then
    tail -40 "$B/build.log" >&2
    echo "device-bundle: the build failed (log: $B/build.log)" >&2
    exit 1
  fi
  for t in strata cuda_ops_test cuda_bench; do [ -x "$B/$t" ] || { echo "device-bundle: $t did not build" >&2; exit 1; }; done

  rm -rf "$OUT"
  mkdir -p "$OUT/bin" "$OUT/lib" "$OUT/usr/bin" "$OUT/usr/share" "$OUT/usr/lib/x86_64-linux-gnu/openmpi/lib"
  cp "$B/strata" "$B/cuda_ops_test" "$B/cuda_bench" "$OUT/bin/"
  cp -L /usr/bin/orterun /usr/bin/orted /usr/bin/ompi_info "$OUT/usr/bin/"
  ln -s orterun "$OUT/usr/bin/mpirun"
  ln -s orterun "$OUT/usr/bin/mpiexec"
  # Plugins (Open MPI's pkglibdir, PMIx's) and help texts, at their paths under usr/.
  cp -a "$ARCH_LIB/openmpi/lib/openmpi3" "$OUT/usr/lib/x86_64-linux-gnu/openmpi/lib/"
  mkdir -p "$OUT/usr/lib/x86_64-linux-gnu/pmix2/lib"
  cp -a "$ARCH_LIB/pmix2/lib/pmix" "$OUT/usr/lib/x86_64-linux-gnu/pmix2/lib/"
  cp -a "$ARCH_LIB/pmix2/share" "$OUT/usr/lib/x86_64-linux-gnu/pmix2/"
  cp -a /usr/share/openmpi "$OUT/usr/share/"
  # Every library those load, by the name the loader asks for.
  skip='^(libc|libm|libpthread|libdl|librt|libutil|libresolv|ld-linux-x86-64|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas|libcublasLt|libnvidia-.*)\.so'
  {
    for f in "$OUT"/bin/* "$OUT"/usr/bin/orterun "$OUT"/usr/bin/orted "$OUT"/usr/bin/ompi_info \
             "$OUT"/usr/lib/x86_64-linux-gnu/openmpi/lib/openmpi3/*.so "$OUT"/usr/lib/x86_64-linux-gnu/pmix2/lib/pmix/*.so; do
      ldd "$f" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
    done
  } | sort -u | while read -r name path; do
    [[ "$name" =~ $skip ]] && continue
    [ -e "$OUT/lib/$name" ] || cp -L "$path" "$OUT/lib/$name"
  done
  cat > "$OUT/env.sh" <<'EOF'
# Source from the repository root on the device machine: the bundle's libraries, Open MPI
# (relocated) and Debian's MCA settings (/etc/openmpi/openmpi-mca-params.conf).
STRATA_BUNDLE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export LD_LIBRARY_PATH="$STRATA_BUNDLE_DIR/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OPAL_PREFIX="$STRATA_BUNDLE_DIR/usr"
export PMIX_INSTALL_PREFIX="$STRATA_BUNDLE_DIR/usr/lib/x86_64-linux-gnu/pmix2"
export PMIX_MCA_mca_base_component_path="$PMIX_INSTALL_PREFIX/lib/pmix"
export PATH="$STRATA_BUNDLE_DIR/usr/bin:$PATH"
export OMPI_MCA_btl_base_warn_component_unused=0 OMPI_MCA_mtl='^ofi' OMPI_MCA_btl='^uct,openib,ofi' \
  OMPI_MCA_pml='^ucx' OMPI_MCA_osc='^ucx,pt2pt'
# Shared memory without the cross-process single copy (CMA), which sandboxed runtimes
# such as gVisor may refuse: two ranks on the one GPU exchange through copies instead.
export OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# CUDA's runtime and cuBLAS: the toolkit's first, then any that Python's nvidia-* wheels
# hold (the image has PyTorch's), for a toolkit without them.
for d in $(python3 -c "import glob, site; print(' '.join(d for sp in site.getsitepackages() for d in sorted(glob.glob(sp + '/nvidia/*/lib'))))" 2>/dev/null); do
  LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d"
done
export LD_LIBRARY_PATH
EOF
  du -sh "$OUT"
  echo "device bundle ready: carry .device-bundle; on the device: source .device-bundle/env.sh && STRATA_BUNDLE=.device-bundle scripts/device-check.sh \$OUT"
  exit 0
fi

# --self-test: the bundle's binaries and Open MPI with the system's trees moved aside, so
# nothing is found where this machine's packages put it. Restored however the test ends.
[ -x "$OUT/bin/strata" ] || { echo "device-bundle: build the bundle first" >&2; exit 1; }
hidden=("$ARCH_LIB/openmpi" "$ARCH_LIB/pmix2" /usr/share/openmpi /etc/openmpi)
restore() { for d in "${hidden[@]}"; do [ -e "$d.hidden-by-bundle-test" ] && mv "$d.hidden-by-bundle-test" "$d"; done; }
trap restore EXIT
for d in "${hidden[@]}"; do mv "$d" "$d.hidden-by-bundle-test"; done
(
  cd "$ROOT"
  # shellcheck disable=SC1091
  source .device-bundle/env.sh
  export PATH="$STRATA_BUNDLE_DIR/usr/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
  set -x
  command -v mpirun
  .device-bundle/bin/strata train --model tiny-gpt --plan tp=1 --steps 2 --quiet --json /tmp/bundle-one.json
  mpirun --oversubscribe -np 2 .device-bundle/bin/strata train --model tiny-gpt --plan tp=2 --steps 2 --quiet \
    --json /tmp/bundle-two.json
  .device-bundle/bin/cuda_ops_test --gtest_brief=1 | tail -3
)
echo "device-bundle self-test passed"
