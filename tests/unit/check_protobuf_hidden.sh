#!/bin/sh
# Fails when the shared library exports a protobuf symbol or one of dtrain's generated TensorBoard
# messages: they are kept inside libdtrain so that another protobuf in the process (a LibTorch that
# carries its own, a user's) can neither bind to dtrain's nor lend dtrain its own.
#   check_protobuf_hidden.sh LIBRARY
lib="$1"
[ -f "$lib" ] || { echo "check_protobuf_hidden: no library $lib"; exit 1; }
exported=$(nm -D --defined-only "$lib" | c++filt | grep -E 'google::protobuf|dtrain::tensorboard::proto' | head -5)
if [ -n "$exported" ]; then
  echo "check_protobuf_hidden: $lib exports protobuf symbols, e.g.:"
  echo "$exported"
  exit 1
fi
# The check must see the encoders at all: the library does contain them (as local symbols).
nm "$lib" | c++filt | grep -q 'dtrain::tensorboard::scalar_event' ||
  { echo "check_protobuf_hidden: $lib has no TensorBoard encoder (was it built without it?)"; exit 1; }
echo "check_protobuf_hidden: $lib exports no protobuf symbol"
