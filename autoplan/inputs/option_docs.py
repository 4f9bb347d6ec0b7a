"""The longer docs of plan()'s options, in the words of docs/api.md (and docs/command-line.md: `*_CLI_DOC`).

`inputs.options` reads them into each option's metadata; docs/api.md's table and `help(autoplan.plan)` are made from that.
"""

BUDGET_DOC = (
    '`"20GB"` (10⁹), `"20 GiB"` (2³⁰), `"512MB"`, `"1.5TB"`, an int of bytes, or `"80%"` of the device\'s memory. An int may '
    'be any integer type (numpy\'s too). Anything else (`"20"`, `"0"`, `"-1GB"`, `"0GB"`, `"20Gb"` (gigabits), NaN, a float) '
    "is a `ValueError` listing the accepted forms, and so is a budget above the device's memory unless "
    '`allow_over_device=True` (the plan then notes that it fits the budget, not the device). A budget in GB/TB/MB that '
    'names a GPU\'s memory (`"24GB"` or `"25.8GB"` on a 24 GiB card, `"80GB"` on the h100-80gb) is the whole card, and '
    '`plan.notes` says how it was read.'
)
DEVICE_DOC = (
    '`"cuda"`/`"cuda:N"` (this machine\'s GPU, as torch names it), a profile name (`a100-40gb`, `a100-80gb`, `a10g`, '
    '`gh200`, `h100-80gb`, `h200`, `l4`, `l40s`, `rtx-3090`, `rtx-4090`, `rtx-a6000`, `t4`, `v100-16gb`, `v100-32gb`, `cpu`; aliases '
    'like `h100`, `4090`, `a6000`; `a100` and `v100` must say their memory size), a card of your own '
    '(`"custom:memory=48GiB,fp32_tflops=91.6,bandwidth=864GB/s,..."` or a `.json` file: '
    '[command-line.md](command-line.md)), or a `torch.device` (`cpu`, or a CUDA device of this machine). **`None` = the '
    "current CUDA device (matched by name, real memory from torch); without CUDA, the `cpu` profile (this machine's RAM).** "
    "Pass a GPU name to plan for a card you don't have."
)
UNITS_DOC = (
    'name patterns of the submodules to plan, e.g. `["layers.*"]`. Default: the submodule class the model repeats that '
    'covers the most parameters (transformer blocks, ResNet blocks); for a model with none, runs of its `nn.Sequential` cut '
    'so each starts at a layer with parameters (named like `"net[0:2]"`); for a model with neither, runs of its `torch.fx` '
    'graph between articulation points (nodes every path from input to output passes through), again one parametric layer '
    'per run (named after the run\'s first and last node, like `"graph[fc_in:gelu]"`; the rewrite runs the model\'s forward '
    'through a GraphModule of its own layers, kept outside `state_dict()`).'
)
MOE_DOC = (
    'mixture-of-experts layers written as a per-expert loop (`torch.where(expert_mask[e])`): None (default) profiles the '
    'worst case, every expert receiving every token (holds for any routing); a positive number c profiles c × tokens × '
    'top_k / experts tokens per expert (routing above it may peak above the plan). Anything else is an `OptionError`; a '
    'capacity on a model with no such routing is a note. `plan.model.moe_routing` says what was assumed ("worst case", '
    '"capacity 1.25", "any" for grouped-matmul experts, "" for none).'
)
FUSE_LOSS_DOC = (
    "True (default): where the forward takes `F.cross_entropy` of its output Linear's logits (through reshapes that keep "
    "the class dimension last and `.float()`; mean or sum, any `ignore_index`), the loss and that Linear's gradients are "
    'computed together, in chunks of rows, during the forward (a fused linear cross-entropy, '
    "`autoplan/planned/loss_head.py`): the log-softmax and the logits' gradient are never held whole and no FLOP is added, "
    "but the head's gradients accumulate in fp32 and take time: the plan is solved both ways and fused only where that is "
    'the faster plan that fits (a caller that keeps the logits through backward holds more in some phases with it fused: '
    '[plan_quality.md](plan_quality.md#the-loss-head-a-fused-linear-cross-entropy-fuse_losstrue-the-default)). '
    '`plan.decisions.fused_loss` says whether it was fused and `plan.decisions.fused_logits` names the logits ("4096×32000 '
    'logits"; "" when nothing was fused). A loss computed outside the model (`loss_fn=`), label smoothing, class weights, '
    '`reduction="none"`, no gradient (eval, `no_grad`) and torch.compile run as written; so does everything with '
    '`compile=True` or `world_size` ≠ 1. Losses and gradients equal the loss as written to float rounding; a second '
    'derivative through the loss is an error. False: as written.'
)
OFFLOAD_DOC = (
    'None (default): on for a GPU target planned for one GPU, off for the CPU and with FSDP. Keep and full units may then '
    'hold what they save in pinned host memory (`Choice.placement == "host"`), copied over the device\'s host link '
    '(`Device.host_bandwidth`) on a side stream; the program chooses it per unit, with checkpointing and precision, where '
    'it is the fastest way to fit ([offload.md](offload.md)). False: everything on the device. True where it cannot be (the '
    'CPU, `world_size` ≠ 1): an `OptionError`.'
)
COMPILE_CLI_DOC = (
    'plan for the model you will run under `torch.compile` (`autoplan.plan(..., compile=True)`): recomputing ops without '
    'FLOPs is priced as free, as Inductor fuses them, so units save matmul/attention outputs and recompute the rest; '
    "`time_source` is `roofline, compiled (elementwise fused)`, the peaks stay the eager model's, the loss is kept as "
    'written. Compile after applying the plan'
)
BUDGET_CLI_DOC = (
    'memory for the training step: `24GB`, `24 GiB`, `512MB`, `80%` (of the device), `1234B` (required). A budget in '
    "GB/TB/MB whose number is a GPU's memory, to the digits typed, in that unit or its binary twin, is the whole card: "
    "`24GB` on a 24 GiB card is the card (vendors sell GiB as GB), and so is `25.8GB`; the plan's notes say so. `GiB` and "
    'bytes are taken as written'
)
