"""What the rewrite passes and the runtime both use, below both of them.

    aten.py          naming and classifying operators across front ends
    meta.py          the node.meta / gm.meta keys that analyses and rewrites write
    params.py        the nodes that read each parameter, the attributes that hold them
    shards.py        this rank's slice of a tensor, and the whole from every slice
    collectives.py   autograd-aware collectives over a named process group
    vocab_parallel.py  the masked lookup of an embedding sharded over the vocabulary
    vocab_parallel_loss.py  cross-entropy from logits sharded over the vocabulary
    loss_match.py    recognizing a loss function as a standard cross-entropy
    flat_buckets.py  flat buckets of tensors: layout, all-gather, gradient reduce-scatter
    zero3.py         ZeRO-3's sharded parameters and their gather start / wait
    groups.py        this rank's coordinate and process group on each mesh axis
    stage_info.py    what the runtime knows of a pipeline stage beyond its graph
    program.py       RankProgram: what the rewrite hands the runtime; a program made
                     again for new input shapes, holding the first one's tensors

Passes insert calls to these functions and modules into graphs; the runtime runs them.
Nothing here imports passes, runtime, cost_models, solver or api.
"""
