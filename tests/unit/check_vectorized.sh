#!/bin/sh
# Passes when the object file $1 holds packed float instructions (the shared-memory reduction loops
# were vectorized). Usage: check_vectorized.sh OBJECT...
for obj in "$@"; do
  if objdump -d "$obj" | grep -qE '[[:space:]]v?(addps|maxps)[[:space:]]'; then exit 0; fi
done
echo "check_vectorized: no packed float add/max in $*: the reduction loops were not vectorized (is -O3 applied, or is a precompiled header overriding it?)" >&2
exit 1
