#!/usr/bin/env bash
# Build native/build/libfmoe_native.so with nvcc.
#   native/build.sh            SASS for sm_80, sm_90, sm_100 plus compute_100 PTX
#   native/build.sh 90         only the listed architectures (SASS + PTX of the last one)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
archs=("$@")
[ ${#archs[@]} -eq 0 ] && archs=(80 90 100)
gencode=()
for a in "${archs[@]}"; do gencode+=(-gencode "arch=compute_${a},code=sm_${a}"); done
last="${archs[${#archs[@]}-1]}"
gencode+=(-gencode "arch=compute_${last},code=compute_${last}")
mkdir -p "$here/build"
nvcc -O3 -std=c++17 -shared -Xcompiler -fPIC,-fvisibility=hidden -Xcompiler -Wall \
  "${gencode[@]}" -I"$here" \
  "$here/w4a16.cu" "$here/fp8_block_gemm.cu" "$here/dispatch_combine.cu" "$here/version.cu" \
  -o "$here/build/libfmoe_native.so"
echo "built $here/build/libfmoe_native.so (sm_${archs[*]})"
