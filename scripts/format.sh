#!/usr/bin/env bash
# Lays out dtrain's C++ as .clang-format says (clang-format 14, Debian's).
#   scripts/format.sh          rewrites every file that differs
#   scripts/format.sh --check  lists the files that differ and fails if any does (ctest format_check)
# The gloo stand-ins in src/compat/gloo_opaque/ copy the layout of the declarations they stand for,
# and are left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-format >/dev/null || { echo "format: clang-format not found: apt-get install clang-format" >&2; exit 2; }
mapfile -t files < <(git ls-files '*.cpp' '*.h' '*.hpp' | grep -v '^src/compat/gloo_opaque/')
if [ "${1:-}" = --check ]; then
  bad=()
  for f in "${files[@]}"; do
    clang-format --style=file "$f" | cmp -s - "$f" || bad+=("$f")
  done
  if ((${#bad[@]})); then
    echo "format: ${#bad[@]} file(s) differ from .clang-format's layout (run scripts/format.sh): ${bad[*]}" >&2
    exit 1
  fi
  echo "format: ${#files[@]} files as .clang-format lays them out"
else
  clang-format --style=file -i "${files[@]}"
fi
