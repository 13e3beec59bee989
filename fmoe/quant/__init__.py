"""fmoe.quant: low-precision expert weights (FP8 row/block, MXFP4, MXFP8, NVFP4), and
quantized training of float master weights (:mod:`fmoe.quant.training`).

See spec/formats.md for the bit-level rules; QuantizedTensor for the packed layout.
"""
from .tensor import QuantizedTensor, bits_per_weight, is_quantized
from .formats import (
    dequantize,
    quantize,
    quantize_fp8_act_tiles,
    quantize_fp8_block,
    quantize_fp8_rowwise,
    quantize_mxfp4,
    quantize_mxfp8,
    quantize_nvfp4,
)
from .hugepages import huge_pages
from .matmul import (
    calibrate_crossover,
    crossover,
    expert_matmul,
    expert_matmul_reference,
)
from .layouts import (
    from_deepseek_fp8,
    from_gpt_oss,
    from_modelopt_nvfp4,
    nvfp4_alpha,
    stack,
    swizzle_offset,
    swizzle_scales,
    to_deepseek_fp8,
    to_gpt_oss,
    to_modelopt_nvfp4,
    unswizzle_scales,
)
from .training import (
    TrainPrecision,
    fake_quantize,
    quantized_mm,
    quantized_mm_reference,
    recipe_from_name,
)
