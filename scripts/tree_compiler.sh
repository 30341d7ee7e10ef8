#!/usr/bin/env bash
# Makes <tree> ready to be configured with the C++ compiler <cxx>: where the tree's CMake cache names
# another compiler, the cache goes (CMakeCache.txt and CMakeFiles/; the objects stay and rebuild).
# Without this, CMake deletes the cache itself on the next configure and drops that command's -D
# options with it: a tree configured by GCC before build_tree.sh or sanitize.sh chose clang would be
# built once with defaults (a sanitizer tree without its sanitizer).
#   ./scripts/tree_compiler.sh build-asan clang++
set -euo pipefail
tree=$1 cxx=$2
cache="$tree/CMakeCache.txt"
[ -f "$cache" ] || exit 0
want=$(command -v "$cxx")
have=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$cache")
if [ -n "$have" ] && [ "$(readlink -f "$have")" != "$(readlink -f "$want")" ]; then
  echo "tree_compiler.sh: $tree was configured with $have; configuring it anew with $want"
  rm -rf "$cache" "$tree/CMakeFiles"
fi
