"""Sharding on one named device mesh: data parallelism, FSDP and tensor parallelism
by partition rules, with XLA's automatic partitioning doing the rest.

    mesh = make_mesh({"data": -1, "fsdp": 2, "tensor": 2})
    rules = rules_for(model, mesh)                  # the model's TP rules + FSDP
    state_sh = state_shardings(state, mesh, rules, optimizer=opt)
    state = shard(state, state_sh)
    batch_sh = batch_sharding(mesh)                 # the batch over data x fsdp
    step = eqtrain.jit(train_step(loss, opt), shardings=(state_sh, batch_sh))
"""

from ._describe import (
    LeafRow as LeafRow,
    describe as describe,
    format_bytes as format_bytes,
    format_table as format_table,
)
from ._mesh import (
    AXES as AXES,
    BATCH_AXES as BATCH_AXES,
    axis_sizes as axis_sizes,
    batch_divisor as batch_divisor,
    batch_sharding as batch_sharding,
    check_batch as check_batch,
    make_mesh as make_mesh,
)
from ._place import (
    path_name as path_name,
    shard as shard,
    state_shardings as state_shardings,
)
from ._rules import (
    FSDP_MIN_SIZE as FSDP_MIN_SIZE,
    LAYERS as LAYERS,
    Rule as Rule,
    Rules as Rules,
    model_rules as model_rules,
    rules_for as rules_for,
)
from ._shard_map import (
    data_parallel as data_parallel,
    data_parallel_step as data_parallel_step,
    replicated as replicated,
)
