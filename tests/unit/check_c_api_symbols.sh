#!/bin/sh
# Fails when libdtrain_c exports any symbol but the C API's dtrain_c_* functions (a binding must see
# nothing of LibTorch's or dtrain's C++ through it: those would clash with its own LibTorch's), or
# when a function include/dtrain_c.h declares is not exported.
#   check_c_api_symbols.sh LIBRARY HEADER
lib="$1"
header="$2"
[ -f "$lib" ] || { echo "check_c_api_symbols: no library $lib"; exit 1; }
exported=$(nm -D --defined-only "$lib" | awk '{print $3}' | sort -u)
[ -n "$exported" ] || { echo "check_c_api_symbols: $lib exports nothing"; exit 1; }
others=$(echo "$exported" | grep -v '^dtrain_c_' | head -5)
if [ -n "$others" ]; then
  echo "check_c_api_symbols: $lib exports symbols outside the C API, e.g.:"
  echo "$others" | c++filt
  exit 1
fi
missing=""
for fn in $(grep -o 'DTRAIN_C_API [^(]*(' "$header" | grep -o 'dtrain_c_[a-z_]*(' | tr -d '('); do
  echo "$exported" | grep -qx "$fn" || missing="$missing $fn"
done
if [ -n "$missing" ]; then
  echo "check_c_api_symbols: $header declares functions $lib does not export:$missing"
  exit 1
fi
echo "check_c_api_symbols: $lib exports $(echo "$exported" | wc -l) symbols, all dtrain_c_*, every declared one"
