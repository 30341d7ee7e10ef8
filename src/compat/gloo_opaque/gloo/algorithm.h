// Opaque gloo (see ../README.md): LibTorch's header includes it but uses nothing from it.
#pragma once

#include "gloo/context.h"
