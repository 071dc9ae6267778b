"""The CPU target's compiler: its stages, in order (the driver is kiln/pipeline.py).

    import            torch.export -> Graph IR; library routines allowed; attention as one
                      `attention` step (kiln_attention.h; Options.fused_attention)
    dce               dead nodes and unused weights dropped
    fold_pads         zero pads folded into the convolutions they feed, identity pads dropped
                      (passes/fold_pad.py)
    gqa_attention     (attention nodes) grouped-query attention reads the kv heads in place,
                      not repeat_kv copies (passes/gqa_attention.py)
    check_user_kernels  user Triton kernels refused (a package cannot run them on the CPU)
    conv_nchwc        (Options.cpu_conv "direct") convolutions as NCHWc direct convolutions,
                      weights packed, epilogues fused (passes/conv_nchwc.py); 1-D ones as
                      one GEMM over a channels-last view (passes/conv1d_gemm.py)
    quant_weights     (Options.weight_quant, cpu_bf16_gemm) constant GEMM weights stored
                      quantised / bf16-packed for kiln_qgemm.h (passes/quant_weights.py)
    freeze            (Options.freeze) weights stored in the layout their GEMMs read
    expand_lowp       low-precision GEMMs as float32 / int32 GEMMs
    widen_half        float16 / bfloat16 as storage types, computed in float32
    lower             Graph IR -> Loop IR
    schedule          Loop IR -> kernels
    gemm_epilogues    (Options.cpu_gemm_epilogue) pointwise consumers fused into their GEMMs
                      (gemm/fuse_cpu.py)
    localize          fused intermediates as per-thread rows
    conv_backends     (direct convolutions) each one's backend: kiln_conv.h, or oneDNN where
                      Options.cpu_conv_backends allows it and max_autotune measured it faster
                      (targets/cpu/dnnl.py)
    reorder           (Options.reorder_for_memory) the order of lowest peak memory
    program           Program IR, with in-place reuse
    plan              the arena plan
    gemm_autotune     each GEMM's backend (BLAS or kiln's "cpp" GEMM) and config
    gemm_onednn       (Options.cpu_gemm_backends with "onednn") GEMMs with a constant B given
                      to oneDNN's matmul where max_autotune measured it faster (or forced)
                      (targets/cpu/dnnl_gemm.py)
    pack_weights      constant B operands of packed "cpp" GEMMs stored prepacked
    codegen           C++ kernel files, the GEMM file
    codegen_wrapper   the C++ wrapper (model.cpp) and the Python one (model.py)
    compile           model.so (parts timed as compile.compile, compile.link)
    default_variant   (max_autotune) the package with the heuristic's GEMM choices too, for
                      kiln.compile to time against the tuned one and keep the faster"""

from __future__ import annotations

from kiln.targets.cpu.build import (CpuBuild, check_user_kernels, codegen, codegen_wrapper,
                                    compile_library, conv_backends, expand_low_precision,
                                    fuse_gemm_epilogues, gemm_autotune, gemm_epilogues_enabled,
                                    gqa_attention, has_attention, libraries, localize,
                                    onednn_gemms, onednn_gemms_enabled, pack_constant_b,
                                    widen_half_types)
from kiln.targets.cpu.never_lose import default_variant, tuned
from kiln.targets.cpu.conv import direct_conv, direct_conv_enabled
from kiln.targets.cpu.quant import quant_enabled, quant_weights
from kiln.targets.stages import (DCE, FOLD_PADS, FREEZE, LOWER, PLAN, REORDER, SCHEDULE,
                                 Stage, Target, check_graph, graph_text, import_stage,
                                 program_stage, source_files, steps_text)

TARGET = Target("cpu", (
    import_stage(library_routines=True, fused_attention=True),
    DCE,
    FOLD_PADS,
    Stage("gqa_attention", gqa_attention, dump=graph_text, verify=check_graph,
          when=has_attention),
    Stage("check_user_kernels", check_user_kernels),
    Stage("conv_nchwc", direct_conv, dump=graph_text, verify=check_graph,
          when=direct_conv_enabled),
    Stage("quant_weights", quant_weights, dump=graph_text, verify=check_graph,
          when=quant_enabled),
    FREEZE,
    Stage("expand_lowp", expand_low_precision, dump=graph_text, verify=check_graph),
    Stage("widen_half", widen_half_types, dump=graph_text, verify=check_graph),
    LOWER,
    SCHEDULE,
    Stage("gemm_epilogues", fuse_gemm_epilogues, dump=steps_text, when=gemm_epilogues_enabled),
    Stage("localize", localize),
    Stage("conv_backends", conv_backends, dump=steps_text, when=direct_conv_enabled),
    REORDER,
    program_stage(inplace=True),
    PLAN,
    Stage("gemm_autotune", gemm_autotune),
    Stage("gemm_onednn", onednn_gemms, when=onednn_gemms_enabled),
    Stage("pack_weights", pack_constant_b),
    Stage("codegen", codegen),
    Stage("codegen_wrapper", codegen_wrapper, dump_files=source_files),
    Stage("compile", compile_library),
    Stage("default_variant", default_variant, when=tuned),
), state=CpuBuild, kernel_kind="cpp", libraries=libraries)
