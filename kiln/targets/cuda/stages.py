"""The CUDA target's compiler: its stages, in order (the driver is kiln/pipeline.py).

Before the export (kiln.compile; `prestart`, targets/cuda/build.py `Early`): Triton's cache
key hashed, the wrapper's header precompiled and, where launch configs will be tuned, the
CUDA driver initialised and the compile workers started, all beside torch.export; the stages
triton_key, workers and wrapper_header then take what was started.

    import            torch.export -> Graph IR; ops kiln would lower to CPU library routines
                      call ATen; scaled_dot_product_attention stays one `attention` node
                      (Options.fused_attention)
    triton_key        Triton's cache key hashed in a thread while the front end runs (the
                      compile workers need it)
    wrapper_header    the wrapper's includes precompiled by a compiler process started
                      while the front end runs (the compile stage uses it where ready)
    workers           Triton compile worker processes started while the front end runs,
                      used by launch_autotune and cubins (triton_aot.Workers)
    dce               dead nodes and unused weights dropped
    fold_pads         zero pads folded into the convolutions they feed, identity pads dropped
                      (passes/fold_pad.py, as on the CPU)
    gqa_attention     (attention nodes) grouped-query attention reads the kv heads in place,
                      not repeat_kv copies (passes/gqa_attention.py)
    merge_gemms       (Options.fold_constants) GEMMs sharing their input and reading weights
                      become one GEMM on the weights concatenated (merged q/k/v, gate/up)
    quant_weights     (Options.weight_quant) constant GEMM weights stored int8 / int4: M = 1
                      GEMMs read them in kiln's GEMV template (its fusions kept), others call
                      quantised GEMM Triton kernels (targets/cuda/quant.py)
    freeze            (Options.freeze) weights stored in the layout their GEMMs read
    conv_nhwc         (Options.cuda_conv "implicit") 2-D convolutions as channels-last kiln
                      kernels, batch norm folded, epilogues fused (passes/conv_nhwc.py)
    mixed_gemm        (Triton GEMMs allowed) GEMMs of int8 tensors converted to float read int8
    lower             Graph IR -> Loop IR; sums of a GEMM's result read several times
                      stored once, for the GEMM's epilogue (passes/store_once.py)
    schedule          Loop IR -> kernels (Triton kernels keep tiles: no per-thread rows);
                      tiny members gathered into fewer launches (schedule's `tiny`)
    reorder           (Options.reorder_for_memory) the order of lowest peak memory
    gemm_autotune     each GEMM's backend (cuBLAS / cuBLASLt, Triton template, CUTLASS)
    fuse_gemms        GEMMs absorb their epilogue (Triton template, CUTLASS visitor tree)
    fuse_puts         (Options.fuse) small KV-cache writes (put) in one launch with the
                      one-row kernel before them (schedule/puts.py)
    program           Program IR, no in-place reuse (threads of a Triton program do not run
                      in lock step)
    async_collectives (collectives) each collective's wait as late as the data allows, its
                      operand kept until then (targets/collectives.py)
    plan              the arena plan
    check_routines    library routines without a CUDA version refused (CUDA has attention,
                      put / put_mean: index_put and scatter, targets/cuda/put.py and
                      put_reduce.py; scans and nonzero, scan.py; collectives)
    launch_autotune   (Options.autotune, a local GPU) kernels' launch configs, attention
                      block sizes and NHWC convolution tiles measured, what the cost model
                      says can matter (targets/cuda/tune_plan.py), all compiled in one pass
    codegen_triton    kernels_triton.py
    cubins            cubins per architecture (parts timed as cubins.<part>)
    user_kernel_configs  (user Triton kernels) a config each
    cubins_user       user kernels' cubins
    cutlass           (CUTLASS GEMMs chosen) their objects
    codegen_wrapper   model_cuda.cpp and the manifest's record
    compile           model.so (parts timed as compile.compile, compile.link)"""

from __future__ import annotations

from kiln.targets.cuda.build import (CudaBuild, check_routines, codegen_triton, codegen_wrapper,
                                     compile_library, cubins, cubins_user, cutlass,
                                     fuse_gemm_epilogues, fuse_put_calls, fusing,
                                     gemm_autotune,
                                     gqa_attention,
                                     has_attention, has_cutlass,
                                     has_user_kernels, launch_autotune, libraries,
                                     prestart, start_workers, wrapper_header,
                                     mixed_gemm, nhwc_conv, nhwc_conv_enabled,
                                     triton_allowed, triton_key, tunes,
                                     user_kernel_configs)
from kiln.targets.collectives import async_collectives, has_collectives
from kiln.targets.cuda.quant import quant_enabled, quant_weights
from kiln.targets.stages import (DCE, FOLD_PADS, FREEZE, LOWER_STORING_SUMS, MERGE_GEMMS, PLAN,
                                 REORDER, SCHEDULE_TINY, Stage, Target, check_graph, check_program,
                                 graph_text, import_stage, program_stage, program_text,
                                 source_files, steps_text)

TARGET = Target("cuda", (
    import_stage(library_routines=False, fused_attention=True),
    Stage("triton_key", triton_key),
    Stage("wrapper_header", wrapper_header),
    Stage("workers", start_workers),
    DCE,
    FOLD_PADS,
    Stage("gqa_attention", gqa_attention, dump=graph_text, verify=check_graph,
          when=has_attention),
    MERGE_GEMMS,
    Stage("quant_weights", quant_weights, dump=graph_text, verify=check_graph,
          when=quant_enabled),
    FREEZE,
    Stage("conv_nhwc", nhwc_conv, dump=graph_text, verify=check_graph, when=nhwc_conv_enabled),
    Stage("mixed_gemm", mixed_gemm, dump=graph_text, verify=check_graph, when=triton_allowed),
    LOWER_STORING_SUMS,
    SCHEDULE_TINY,
    REORDER,
    Stage("gemm_autotune", gemm_autotune),
    Stage("fuse_gemms", fuse_gemm_epilogues, dump=steps_text),
    Stage("fuse_puts", fuse_put_calls, dump=steps_text, when=fusing),
    program_stage(inplace=False, state_inplace=True),
    Stage("async_collectives", async_collectives, dump=program_text, verify=check_program,
          when=has_collectives),
    PLAN,
    Stage("check_routines", check_routines),
    Stage("launch_autotune", launch_autotune, when=tunes),
    Stage("codegen_triton", codegen_triton),
    Stage("cubins", cubins),
    Stage("user_kernel_configs", user_kernel_configs, when=has_user_kernels),
    Stage("cubins_user", cubins_user),
    Stage("cutlass", cutlass, when=has_cutlass),
    Stage("codegen_wrapper", codegen_wrapper, dump_files=source_files),
    Stage("compile", compile_library),
), state=CudaBuild, numbered=True, kernel_kind="triton", libraries=libraries,
   torch_libraries="libtorch_cpu.so and libtorch_cuda.so", prestart=prestart)
