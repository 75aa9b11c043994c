"""The torch dtype tables of the job side, in one place: config names and safetensors header codes.

Why a room of its own: the loader reads safetensors headers (code -> torch dtype), consolidation
writes them (torch dtype -> code), and both turn the config's dtype names into torch dtypes. Written
in each module, the tables drifted apart in name and direction (two ``SAFETENSORS_DTYPES`` mapping
opposite ways), and consolidation imported the whole loader for one dict. Here the code table is
written once and its inverse derived from it.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# model.dtype / train.precision / consolidate.dtype names -> torch dtype
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

SAFETENSORS_DTYPES = {  # dtype codes of safetensors headers the loader reads (and the scatter sends as they are)
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}

# torch dtype -> safetensors header code: the dtypes consolidation can write
SAFETENSORS_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}
