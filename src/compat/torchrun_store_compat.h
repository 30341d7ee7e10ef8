// The store torchrun hosts, per LibTorch version. PyTorch 2.1 added a handshake (VALIDATE) to c10d's
// TCPStore protocol; a LibTorch 1.13 client's first request is never answered by a 2.x server, whose
// libuv backend just waits: the rank would hang for the store timeout (30 minutes by default). A 1.13
// build therefore asks first, with a request both sides understand the same way, and fails at once
// with the remedy when torchrun is too new. LibTorch 2.x speaks the new protocol: nothing to check.
#pragma once

#include <cstdint>
#include <string>

namespace dtrain::compat {

// Throws dtrain::Error naming `rank` when the TCPStore at host:port speaks a protocol this LibTorch's
// client cannot; returns when it can, or when the store does not answer at all (connecting reports that).
void check_torchrun_store(const std::string& host, uint16_t port, int rank);

}  // namespace dtrain::compat
