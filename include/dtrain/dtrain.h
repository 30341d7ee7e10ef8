// dtrain: distributed training for the PyTorch C++ frontend. One include for the whole public API.
#pragma once

#include "dtrain/amp.h"
#include "dtrain/checkpoint.h"
#include "dtrain/comm_hooks.h"
#include "dtrain/data_parallel.h"
#include "dtrain/ddp.h"
#include "dtrain/errors.h"
#include "dtrain/join.h"
#include "dtrain/monitor.h"
#include "dtrain/pipeline.h"
#include "dtrain/process_group.h"
#include "dtrain/system.h"
#include "dtrain/sampler.h"
#include "dtrain/summary_writer.h"
#include "dtrain/sync_batchnorm.h"
#include "dtrain/zero.h"
#include "dtrain/datasets/fashion_mnist.h"
