#!/bin/sh
# Passes when the object file $1 neither defines nor references any symbol of namespace gloo: the code
# compiled against the opaque gloo headers (src/compat/gloo_opaque) used none of gloo's definitions,
# so it cannot depend on a gloo that differs from the one inside LibTorch (the stand-ins' own
# gloo::opaque constants excepted). It also checks that the
# object does create a ProcessGroupGloo, so an empty object cannot pass.
obj="$1"
syms=$(nm -C "$obj") || { echo "check_gloo_opaque: nm failed on $obj" >&2; exit 1; }
echo "$syms" | grep -q 'c10d::ProcessGroupGloo::ProcessGroupGloo' || {
  echo "check_gloo_opaque: $obj does not call ProcessGroupGloo's constructor: wrong object?" >&2; exit 1; }
bad=$(echo "$syms" | grep -E '(^|[^_[:alnum:]])gloo::' | grep -v 'gloo::opaque::' | grep -vE 'std::(shared_ptr|__shared_ptr|unique_ptr|vector|_Vector_base|allocator|_Sp_)|c10d::ProcessGroupGloo::createDevice')
if [ -n "$bad" ]; then
  echo "check_gloo_opaque: $obj uses gloo symbols, so it depends on gloo's headers:" >&2
  echo "$bad" >&2
  exit 1
fi
exit 0
