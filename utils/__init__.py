"""rocm-cuda-labs' Python package: a small kit the notebooks import, one subpackage per lab family, the
machinery that runs and builds the course, and a floor they all stand on. Imports run one way, downwards:
machinery -> graders -> lab families -> kit -> base. Import the module you need (`from utils import timing`);
this file imports nothing.

The kit (what a lab's notebook imports):
    course      a lab's one setup call: its parameters checked, the device, the report, the grader
    backend     a GPU vendor as one record: its words (wavefront/warp, CU/SM), torch module, compiler targets
    device      which device the course runs on and its published peaks (utils/data/gpu_specs.toml)
    timing      benchmark(): device events on a GPU, perf_counter on the CPU, with spread
    machine     the machine's state around a measurement: clocks, temperature, power, throttling, CPU load
    params      a parameter declared once, on its line of the `parameters` cell, and its checks
    record      a lab's headline figures (size, spread, machine state, validity) and plots, for the report
    exercises   the exercises' contract: grade, NOT DONE, PASS, hints, the reference answer
    grading_guard  what keeps a grade honest: the course's answers out of reach, a time limit, fresh seeds,
                inputs the answer must not change, graders the notebook has not replaced
    solutions   the solution notebooks as code: exercise regions, stubs, exported modules (load())
    plots       plots and Markdown tables shared by the labs
    isa         kernels to machine code for both vendors, ahead of time, on any machine
    occupancy   resident wavefronts/warps per CU/SM from a kernel's registers and shared memory
    simt        a tiny SIMT machine: lanes in lock-step, divergence, masks (lab 02)
    stack       the software stack, and how to install what is missing
    blocks      block-quantized number formats (GGUF's Q4_0, Q4_1, Q8_0, Q4_K; MXFP4, NVFP4): bytes, fields, decoding
    fp8         FP8 formats as records (OCP e4m3fn / e5m2, FNUZ e4m3fnuz / e5m2fnuz), each GPU's dialect, scaled-matmul checks

Lab families:
    llm/        lab 05 (and 06, 07): models, decode (the lean decoder), serving, guard (the limits in front of
                transformers serve), loadgen,
                loadplan (the probe that decides, each level's windows, the levels)
    multigpu/   lab 06: topology, collectives, launch (ranks on one machine, torchrun agents for several), netns (a
                private network for those agents: their TCP stores on 127.0.0.1, in a network namespace), comm (how the
                ranks talk: NCCL/gloo, or a one-shot all-reduce over symmetric memory), oneshot (the course's Triton
                one-shot all-reduce + residual add + RMSNorm), tp (tensor parallelism),
                attribution (where a step's time goes: collectives counted once, compute / communication / idle)
    clinic/     lab 07: doctor, divergence, faults, traces
    quant/      lab 08: gguffile (GGUF files: SmolLM2's, a planted fault, a random Llama), llamacpp (llama.cpp's
                engines and backends: the wheel, a source build's tools), reference (the NumPy forward pass)

The graders (the notebooks import them; one module per lab):
    graders/    lab00, lab01, lab02, lab03, lab04, lab05, lab06, lab07, lab08: each exercise's checker with its cases
                and hints, out of the lesson's way

The machinery (make run, make labs, make report, make check; no notebook imports it):
    machinery/  harness, labs, learner (work/: the learner's copy, its updates, progress), narrate (what a run says
                while a lab runs), report, executed, preflight, workspace (a hub learner's folder), site (the
                course website, make site)

The floor (imports nothing else of the course):
    base/       paths (files, build folder, course.env, ports), state (safe state files), processes
"""
