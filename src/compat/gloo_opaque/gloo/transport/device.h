// Opaque gloo (see ../README.md): incomplete types, usable only through pointers.
#pragma once

namespace gloo::transport {
class Device;
class UnboundBuffer;
}  // namespace gloo::transport
