#!/usr/bin/env bash
# Developer build of the FFI extension into a private folder, without reinstalling the
# package:  tools/build_ffi.sh build/dev   then   PYTHONPATH=build/dev python -m pytest ...
# (Several people can build side by side in different folders.)
set -euo pipefail
out=${1:-build/dev}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
cmake -S "$root" -B "$out/cmake" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$(command -v python3)" >/dev/null
cmake --build "$out/cmake" -j 2
cp "$out"/cmake/_hmoe_ffi*.so "$out"/
echo "built $(ls "$out"/_hmoe_ffi*.so)"
