"""Running a rank's program: `ParallelModule` and what it drives.

    parallel_module.py   train_step, collectives(), full_state_dict()
    executor.py          one stage: microbatches through forward and backward
    pipeline.py          several stages: torch.distributed.pipelining schedules
    shared_params.py     weights tied across pipeline stages, kept in step
    data_parallel.py     gradient sync and the optimizer over the dp axis
    grad_sync.py         bucketed gradient all-reduce overlapped with backward
    zero.py              ZeRO-1/2/3 optimizer state on flat shards
    zero_replicas.py     ZeRO-1/2 shards of replicated parameters
    precision.py         autocast and fp16 loss scaling
    full_state.py        whole parameters from this rank's pieces
    inputs.py            a step's inputs checked against the captured shapes
    programs.py          the plan's programs by input shape: made again for new static sizes
    faults.py            a peer lost mid-step, as an error that says how to resume
    weights.py           models built on the meta device
    checkpoint.py        sharded checkpoints: parameters and optimizer state, any plan
    holdings.py          every tensor of a rank that holds parameter values, as pieces
    pieces.py            where a rank's tensors lie in the model's whole tensors
    dcp_planners.py      torch.distributed.checkpoint planners that write those pieces
    export.py            the whole model's state dict, for one device (from_pretrained)

The runtime imports `ops` and never `passes`: the graphs it runs arrive rewritten.
"""
