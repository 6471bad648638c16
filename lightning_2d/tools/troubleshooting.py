"""The troubleshooting table: every refusal a user meets, one row each (what they see, the cause, what to do).

``REFUSALS`` is data only. ``docs/troubleshooting.md`` shows it as a table (its generated part ``troubleshooting``,
made by ``lightning_2d.tools.docs``), so the page cannot drift from this module. Every code span (backticks) of a
row's ``see`` quotes a message as the user reads it: ``…`` where the message goes on or shows a value of theirs,
the placeholders ``N``, ``K``, ``DIR``, ``FILE``, ``TENSOR`` for numbers and names that vary, a leading
``SomeError: `` for the exception's class, ``lightning-2d COMMAND: error: `` for the command-line tool's line, and
`` / `` between the messages of one row. The other columns are free Markdown.

``cases`` names the cases of ``tests/unit/test_misconfigurations.py`` (``CASES``) that raise the messages quoted.
``tests/unit/test_troubleshooting.py`` keeps the table honest: it runs those cases and checks that each quote is in
the message of one of them and that each of them is quoted; the quotes of a row that names no case (a refusal met
while a job runs: the watchdog, a NaN on some rank) must be in the library's string literals; and every case of
``CASES`` must have its row (or a reason there why not). A changed message fails that test until its row here is
changed with it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Refusal:
    """One row of the troubleshooting table (Markdown text, shown as written)."""

    see: str  #: the message, quoted in backticks: what the user reads
    cause: str  #: why it is refused
    do: str  #: the way out
    cases: tuple[str, ...] = ()  #: the ``test_misconfigurations.CASES`` that raise it (none: checked in the source)


#: Every row of the table, in the order shown.
REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        see="`ParallelConfigError: … must divide n_kv_heads (2); try 1 or 2`",
        cause="`tensor_parallel_size` does not divide the model's head counts",
        do="pick one of the sizes listed",
        cases=("heads not divisible, before spawn",),
    ),
    Refusal(
        see="`sequence length (30) must be divisible by tensor_parallel_size (4)`",
        cause="sequence parallelism splits the sequence evenly",
        do="a multiple of tp, or `sequence_parallel=False`",
        cases=("sequence length not divisible, before spawn",),
    ),
    Refusal(
        see="`data_parallel_size × tensor_parallel_size … must equal the world size`",
        cause="the mesh does not cover the processes",
        do='one of the listed `(dp, tp)` pairs, or `"auto"`',
        cases=("world size mismatch",),
    ),
    Refusal(
        see="`param_dtype='float16' is not supported` / `precision='16-true' is not supported`",
        cause="fp16 needs a gradient scaler FSDP2 × TP does not offer",
        do="`bf16-mixed`",
        cases=("float16 parameters", "float16 precision"),
    ),
    Refusal(
        see="`timeout=30 must be a datetime.timedelta`",
        cause="a number has no unit",
        do="`timedelta(minutes=10)`",
        cases=("a number as timeout",),
    ),
    Refusal(
        see="`Invalid 2D parallel configuration:` then one line per problem, as `… must be a positive integer …, got "
            "0` / `… is not a mode; choose one of …` / `… is not a policy; choose …` / "
            "`… is not a schedule; choose one of …` / `… is invalid; use …` / `… is not a dtype; use one of …` / "
            "`… must be True or False, got 'no' (str)` / `timeout=… must be positive` / "
            "`fsdp_float8_all_gather=True needs float8=True`",
        cause="a strategy option out of its range, a misspelled choice, a flag given as a string, or an option that "
              "needs another",
        do="a value the line lists; every problem of the options is listed at once",
        cases=(
            "tensor_parallel_size 0",
            "replicate size 0",
            "context parallel size 0",
            "unknown AC mode",
            "bad selective option",
            "unknown reshard policy",
            "unknown non_finite policy",
            "unknown pipeline schedule",
            "float8 typo",
            "a dtype typo",
            "a string for a flag",
            "a negative timeout",
            "float8 all-gather without float8",
        ),
    ),
    Refusal(
        see="`fsdp_backend='simple_fsdp' with reshard_after_forward='always' and activation_checkpointing='none'` / "
            "`… reshard_after_forward='never' and activation_checkpointing='full'`",
        cause="SimpleFSDP frees a gathered weight only by recomputing its block",
        do="`activation_checkpointing='full'`/`'selective'` (`'none'` for `'never'`), or "
           "`reshard_after_forward='default'`",
        cases=(
            "SimpleFSDP asked to reshard without activation checkpointing",
            "SimpleFSDP asked to keep weights gathered under activation checkpointing",
        ),
    ),
    Refusal(
        see="`fsdp_backend='simple_fsdp' with float8=True and fsdp_float8_all_gather=True: the float8 all-gather is "
            "FSDP2's …`",
        cause="torchao's float8 all-gather hooks `fully_shard`; SimpleFSDP gathers in `param_dtype` and casts after",
        do="`fsdp_float8_all_gather=False`, or `fsdp_backend='fully_shard'`",
        cases=("SimpleFSDP with FSDP2's float8 all-gather",),
    ),
    Refusal(
        see="`fsdp_backend='simple_fsdp' with compile=True and activation_checkpointing='full' fails in torch 2.13 …`",
        cause="torch 2.13's compiled checkpoint saves a `DeviceMesh` for backward among its tensors and fails every "
              "forward",
        do="`activation_checkpointing='selective'`, `fsdp_backend='fully_shard'`, or `compile=False`",
        cases=("SimpleFSDP with compiled full activation checkpointing in torch 2.13",),
    ),
    Refusal(
        see="`watchdog_timeout=… is under 5 s` / `watchdog_timeout=60 must be a datetime.timedelta`",
        cause="a bound ordinary pauses would trip, or a bare number",
        do="`timedelta(minutes=2)`, or `None` (off)",
        cases=("a watchdog bound too short", "a number as watchdog_timeout"),
    ),
    Refusal(
        see="`[lightning_2d watchdog, rank N] Stopping rank N (exit code 75): rank K …`",
        cause="rank K died, stopped, is stuck or raised (the line says which, with its pid and host)",
        do="read rank K's log; resume with `ckpt_path=\"last\"`",
        cases=(),
    ),
    Refusal(
        see="`process_group_backend='ncll' is not a torch.distributed backend`",
        cause="a typo",
        do='`"nccl"`, `"gloo"`, or `None`',
        cases=("a misspelled backend",),
    ),
    Refusal(
        see="`pipeline_parallel_size × data_parallel_size × tensor_parallel_size … must equal the world size` / "
            "`pipeline_parallel_size (3) must divide the world size`",
        cause="the three sizes do not cover the processes",
        do='one of the listed `(dp, tp)` pairs for that pipeline size, or `"auto"`',
        cases=("three sizes not multiplying to the world", "pipeline size not dividing the world"),
    ),
    Refusal(
        see="`the model has 2 transformer blocks, fewer than the 4 pipeline stages` / "
            "`pipeline_layers_per_stage [3, 3] adds up to 6 blocks but the model has 4` / "
            "`pipeline_layers_per_stage has 1 entries but the pipeline has 2 stages`",
        cause="a stage without blocks, block counts that do not add up, or not one count per stage",
        do="a smaller `pipeline_parallel_size` or `pipeline_stages_per_rank`, or counts adding up to `n_layers`",
        cases=(
            "more stages than blocks, before spawn",
            "block counts not adding up, before spawn",
            "a block count per stage missing",
        ),
    ),
    Refusal(
        see="`pipeline_microbatches (4) must divide the per-rank batch size (6)` / "
            "`pipeline_schedule='1F1B' needs at least pipeline_parallel_size (4) micro-batches`",
        cause="the batch cannot be cut as asked, or the schedule would deadlock",
        do='one of the listed counts; a larger batch; `"GPipe"`',
        cases=("micro-batches not dividing the batch, before spawn", "fewer micro-batches than stages for 1F1B"),
    ),
    Refusal(
        see="`pipeline_schedule='Interleaved1F1B' interleaves several stages per rank, but pipeline_stages_per_rank=1`",
        cause="the schedule needs more stages per rank",
        do='2 or more stages per rank, or `"1F1B"`',
        cases=("interleaved schedule with one stage per rank",),
    ),
    Refusal(
        see="`pipeline_schedule='DualPipeV' needs at least as many micro-batches as stages …` / "
            "`pipeline_schedule='ZBVZeroBubble' splits each backward into its input and weight halves, which torch "
            "2.13 does not support for compiled modules`",
        cause="a V-shaped schedule runs two stages per rank and needs a micro-batch for each; the zero-bubble "
              "schedules split a backward that a compiled block runs whole",
        do="more `pipeline_microbatches` (or a larger batch), or `'ZBVZeroBubble'`; `compile=False`, or "
           "`'Interleaved1F1B'`",
        cases=("DualPipeV with fewer micro-batches than stages", "a zero-bubble schedule with compiled blocks"),
    ),
    Refusal(
        see="`pipeline_parallel_size=2 splits a model into stages by its blocks …`",
        cause="a model the library cannot split (a Hugging Face decoder, your own)",
        do="`pipeline_parallel_size=1`, or `LlamaLightningModule`",
        cases=("HF decoder under pipeline parallelism, before spawn",),
    ),
    Refusal(
        see="`pipeline parallelism cannot split a model with tied parameters (tok_embeddings.weight = output.weight)`",
        cause="tied embeddings (Llama 3.2 1B/3B) under a pipeline: the stages would hold two copies",
        do="`pipeline_parallel_size=1` (FSDP × TP keep the tie)",
        cases=("a tied model under a pipeline",),
    ),
    Refusal(
        see="`DIR does not hold the model's weights (1 problem(s)): model.layers.0.mlp.up_proj.weight: missing` / "
            "`…: stored (32, 32), the model's is (64, 32)`",
        cause="`init_from` files whose tensors (names, shapes) do not match their `config.json` (checked when the "
              "module is built, both paths)",
        do="the directory the `config.json` came with; re-download it",
        cases=(
            "init_from a directory whose tensors do not match its config.json",
            "init_from a directory holding a tensor of another shape",
        ),
    ),
    Refusal(
        see="`DIR/config.json describes a Llama this model cannot represent: attention_bias is True (needs False)`",
        cause="a Llama `config.json` with a field the native model does not compute (biases, another activation, "
              "partial rotary, another `head_dim`)",
        do="`HFCausalLMModule(init_from=...)`",
        cases=("init_from a Llama with attention biases",),
    ),
    Refusal(
        see="`… is split into pipeline stages (pipeline_parallel_size > 1): this rank holds some of its blocks only, "
            "so calling it cannot compute anything` / `fabric.backward under pipeline parallelism` / "
            "`… a term was added outside the pipeline`",
        cause="the pipelined model was called, or `backward` given a loss, as without a pipeline",
        do="step `fabric.strategy.pipeline.train_step(tokens, labels, grad_scale=1 / n)` (`LlamaLightningModule` "
           "does) and return its loss unchanged",
        cases=(),
    ),
    Refusal(
        see="`context_parallel_size (3) must divide the world size` / "
            "`sequence length (36) must be a multiple of 2 × context_parallel_size (2) × tensor_parallel_size (2 …) = "
            "8`",
        cause="the context groups do not cover the processes, or the sequence cannot be cut into `2C` equal chunks "
              "per tensor shard",
        do="one of the listed sizes; a sequence length that is a multiple of the number given",
        cases=(
            "context parallel size not dividing the world",
            "sequence length not a multiple of 2 × context × tensor, before spawn",
        ),
    ),
    Refusal(
        see="`context_parallel_size=2 splits every sequence over 2 ranks … (ParallelPlan.attention=None: e.g. a "
            "Hugging Face decoder …)`",
        cause="a model whose attention cannot exchange keys and values",
        do="`context_parallel_size=1`, or `LlamaLightningModule`",
        cases=("HF decoder under context parallelism, before spawn",),
    ),
    Refusal(
        see="`expert_parallel_size (4) must divide the data-shard × context ranks (2 = …)` / "
            "`… must divide the model's 6 experts` / `expert_parallel_size=2 but the model has no mixture-of-experts "
            "layers`",
        cause="expert ranks come out of the data-shard × context ranks, each holding the same number of experts",
        do="one of the listed sizes; a model with `moe` (`debug-moe`, `mixtral-8x7b`, `qwen3-30b-a3b`)",
        cases=(
            "expert_parallel_size not dividing the data-shard ranks",
            "expert_parallel_size that would fit over the tensor-parallel ranks",
            "experts not divisible by expert_parallel_size",
            "expert parallelism on a dense model",
        ),
    ),
    Refusal(
        see="`expert_parallel_size=2 but the plan names no experts to split (ParallelPlan.expert_parallel is empty)`",
        cause="a plan of your own says the model has experts (`num_experts`) but not which modules hold them",
        do="name each layer's stacked experts in `ParallelPlan(expert_parallel={...: ExpertParallel()})`, as "
           "`llama_plan` does",
        cases=("expert parallelism with a plan naming no experts to split",),
    ),
    Refusal(
        see="`expert_parallel_size (8) with experts_over_tensor_parallel=True must be k × tensor_parallel_size (2) …` "
            "/ `experts_over_tensor_parallel=True with sequence_parallel=False` / "
            "`experts_over_tensor_parallel=True with expert_parallel_size=1 and tensor_parallel_size=2`",
        cause="expert groups that take in the tensor-parallel ranks hold whole tensor-parallel groups, each rank "
              "routing its own slice of the sequence (sequence parallelism)",
        do="one of the listed sizes, `sequence_parallel=True`, or `experts_over_tensor_parallel=False`",
        cases=(
            "experts over the tensor-parallel ranks not k x tp",
            "experts over the tensor-parallel ranks without sequence parallelism",
            "experts over the tensor-parallel ranks without expert parallelism",
        ),
    ),
    Refusal(
        see="`LoRA on transformers' own mixture of experts (HFCausalLMModule, or a transformers model given to "
            "Fabric) is not supported`",
        cause="transformers' fused experts are parameters that take no adapter: the routed experts would stay frozen",
        do="`LlamaLightningModule(init_from=<the same folder>, lora=...)`, which adapts the routed experts",
        cases=("LoRA on transformers' own experts",),
    ),
    Refusal(
        see="`lora.quantize_base='nf4' (QLoRA) on the routed experts`",
        cause="NF4 bases are 2-D weights quantized in blocks and split by rows; the routed experts are stacked 3-D "
              "weights split by expert",
        do="`quantize_base: null`, or `lora.targets` without the routed experts (`[wq, wk, wv, wo, shared_experts.w1, "
           "shared_experts.w2, shared_experts.w3]`)",
        cases=("QLoRA on the routed experts",),
    ),
    Refusal(
        see="`lora.quantize_base='nf4' (QLoRA) with tensor_parallel_size=2` / "
            "`… with data_parallel_replicate_size=2` / `… with fsdp_backend='simple_fsdp'` / `… with compile=True`",
        cause="torchao's NF4 bases are quantized in blocks of the whole weight and sharded by FSDP2 (`fully_shard`) "
              "along their rows over a 1-D mesh, uncompiled",
        do="`tensor_parallel_size=1`, `data_parallel_replicate_size=1`, `fsdp_backend='fully_shard'`, "
           "`compile=False`; or `quantize_base: null`",
        cases=("QLoRA under tensor parallelism", "QLoRA under HSDP", "QLoRA with SimpleFSDP", "QLoRA with compile"),
    ),
    Refusal(
        see="`preference reference='adapters_off' needs adapters to switch off` / "
            "`preference reference='copy' with lora=`",
        cause="a reference of switched-off adapters for a model without them; a second copy beside adapters",
        do="`reference: copy` (or `auto`) for the whole model; `reference: adapters_off` (or `auto`) under `lora`",
        cases=(
            "a preference reference of switched-off adapters without adapters",
            "a preference reference copy beside adapters",
        ),
    ),
    Refusal(
        see="`preference loss_type='kto' scores unpaired examples … but the PreferenceDataModule's rows are pairs` / "
            "`loss_type='sigmoid' compares a chosen and a rejected completion … rows are unpaired examples`",
        cause="KTO reads unpaired rows (`prompt`, `completion`, `label`), the pairwise losses pairs",
        do="rows of the loss's kind: `format: unpaired` (pairs unpaired by `data.preference.unpaired_rows`) for KTO, "
           "or another `loss_type`",
        cases=("KTO on pairs", "a pairwise preference loss on unpaired examples"),
    ),
    Refusal(
        see="`DistillationConfigError: LlamaLightningModule has a teacher (…) but no distillation=` / "
            "`… (distillation=...) needs teacher=`",
        cause="one of the pair without the other",
        do="both, or neither",
        cases=("a teacher without distillation settings", "distillation settings without a teacher"),
    ),
    Refusal(
        see="`the teacher (…) has a vocabulary of 320 tokens, the student 256` / "
            "`the teacher's tokenizer (…) maps other tokens to ids than the student's (…)`",
        cause="distillation compares the two distributions id by id",
        do="a teacher with the student's tokenizer (and vocabulary)",
        cases=("a teacher of another vocabulary", "a teacher whose tokenizer maps other tokens"),
    ),
    Refusal(
        see="`teacher='llama-9b' is neither a model folder (no directory there) nor a preset`",
        cause="a mistyped preset or folder",
        do="a preset listed, an existing folder, or `{model:, init_from:, model_overrides:}`",
        cases=("a teacher that is neither a folder nor a preset",),
    ),
    Refusal(
        see="`distillation beta=0.5 weighs jsd's mixture, but loss='forward_kl'` / `alpha must be in (0, 1]`",
        cause="settings that select no divergence, or no teacher's share",
        do="`loss: jsd` for `beta`; `alpha` in (0, 1]",
        cases=("distillation settings that select no divergence", "a distillation weight out of range"),
    ),
    Refusal(
        see="`distillation= with preference={'loss_type': 'sigmoid', ...}: one step trains one objective`",
        cause="a teacher and a preference loss in one run",
        do="distil first, tune preferences from its export",
        cases=("distillation and a preference loss in one step",),
    ),
    Refusal(
        see="`distillation with pipeline_parallel_size=2 is not supported yet`",
        cause="the student's last stage would need the teacher's hidden states and head per micro-batch",
        do="`pipeline_parallel_size=1` (FSDP, tensor and context parallelism shard both models)",
        cases=("distillation under pipeline parallelism",),
    ),
    Refusal(
        see="`tensor_parallel_size (4) must divide the teacher's n_kv_heads (2)`",
        cause="the teacher is tensor-parallel where the student is, by its own plan",
        do="a size dividing both models' head counts",
        cases=("a teacher whose heads tensor parallelism does not divide",),
    ),
    Refusal(
        see="`Transformer is a frozen model held beside the trained one (every parameter requires_grad=False), but "
            "pipeline_parallel_size=2 would split it`",
        cause="a reference or teacher given to `fabric.setup` under a pipeline: Fabric steps the trained model's "
              "pipeline only, and the loop would call the frozen one whole",
        do="`pipeline_parallel_size=1`, or the Trainer (`LlamaLightningModule(preference=...)` splits its reference "
           "copy beside the trained stages)",
        cases=("a frozen model given to fabric.setup under pipeline parallelism",),
    ),
    Refusal(
        see="`expert_parallel_size=2 with HFCausalLMModule` / `… output_router_logits=True …`",
        cause="transformers' experts run whole on each rank, and its auxiliary loss would be per rank",
        do="`LlamaLightningModule(init_from=...)` (the same files), or `output_router_logits: false`",
        cases=(
            "expert parallelism on the Hugging Face path",
            "Hugging Face mixture of experts asking for transformers' per-rank auxiliary loss",
        ),
    ),
    Refusal(
        see="`HFCausalLMModule cannot train this model: model_type 'gpt2' is not one of the Llama-family decoders the "
            "built-in plan knows (…)`",
        cause="the Hugging Face path's built-in plan knows the Llama family only",
        do="your own `ParallelPlan` to the strategy (`plan=`), or `parallel_plan(config)` on your LightningModule",
        cases=("HF model outside the family",),
    ),
    Refusal(
        see="`document_mask=True needs an end-of-text token` / `… cannot take them (its supports_document_mask is "
            "False …)`",
        cause="document masking where it cannot work: a tokenizer without an end-of-text token, a module whose "
              "`supports_document_mask` is False (your own)",
        do="`eos_token=...`; `LlamaLightningModule` or `HFCausalLMModule`; or `document_mask=False`",
        cases=(
            "document masking with a tokenizer without an end-of-text token",
            "document masking for a module that cannot take it, before spawn",
        ),
    ),
    Refusal(
        see="`sequence_parallel=False, but the plan's tensor_parallel holds sequence-parallel styles`",
        cause="a static plan with SP styles",
        do="move them to `ParallelPlan(sequence_parallel={...})`",
        cases=("SP styles with sequence_parallel=False",),
    ),
    Refusal(
        see="`MaterializationError: … left without values`",
        cause="a meta-device model with tensors no init route fills",
        do="`param_init_specs()`/`init_buffers()`, see [Bring your own model](models/bring-your-own.md)",
        cases=(),
    ),
    Refusal(
        see="`NonFiniteLossError` (first step) / `NonFiniteStepError: Step N stopped before the update (…rank(s) […])`",
        cause="NaN/inf in the loss or gradients on some rank",
        do='lower the learning rate, check the data; `non_finite="skip"` to drop such steps',
        cases=(),
    ),
    Refusal(
        see="`NonFiniteWeightsError: Not saving …`",
        cause="weights already NaN/inf",
        do="resume from the last checkpoint",
        cases=(),
    ),
    Refusal(
        see="`CheckpointError: Checkpoint … does not exist. Not resuming from another checkpoint` (the CLI: "
            "`lightning-2d fit: error: Checkpoint …`, before any process starts)",
        cause="an explicit `ckpt_path` that is mistyped, interrupted or damaged (the message names the file)",
        do='the newest complete checkpoint it names, or `ckpt_path="last"`',
        cases=("explicit checkpoint that does not exist",),
    ),
    Refusal(
        see="`CheckpointError: … does not fit the model …: checkpoint (256, 128), model (256, 256)`",
        cause="resuming into a different model size",
        do="the model the checkpoint was saved from",
        cases=(),
    ),
    Refusal(
        see="`rope_scaling.factor must be a number of at least 1, got 0.5` / "
            "`rope_scaling.rope_type 'yarn' is not supported; supported: 'llama3'`",
        cause="a `rope_scaling` (in `ModelArgs` or `model_overrides`) outside Llama 3.1's scaling",
        do='the values the message accepts (`{"rope_type": "llama3", "factor": 8.0, …}`), or `None` for none',
        cases=("a rotary scaling override out of range", "a rotary scaling override of another type"),
    ),
    Refusal(
        see="`… uses the rotary scaling rope_type 'yarn', which this model does not implement; supported: 'default' "
            "(no scaling) and 'llama3'`",
        cause="`init_from` a Llama whose `config.json` scales its rotary embedding another way (linear, dynamic, "
              "yarn, …)",
        do="`HFCausalLMModule(init_from=...)`: transformers' model computes every scaling it knows",
        cases=("init_from a Llama with another rotary scaling",),
    ),
    Refusal(
        see="`Unknown model name 'llama9-1t'. Known names: …` / `loss_chunk_size must be a positive number of tokens, "
            "got 0` / `Invalid ModelArgs: moe: … load_balancing must be 'aux_loss', 'bias' or 'none', got 'aux'` / "
            "`Invalid TextDataModule arguments: seq_len must be a positive integer, got 0` / "
            "`… val_fraction must be in [0, 1), got 1.5`",
        cause="a misspelled preset or setting, or a module's or data module's value out of its range",
        do="a name the message lists, or a value in the range it gives",
        cases=(
            "unknown preset",
            "loss chunk 0",
            "mixture-of-experts setting misspelled",
            "data seq_len 0",
            "validation fraction 1.5",
        ),
    ),
    Refusal(
        see="`DataError: The model's vocab_size (…) is smaller than the tokenizer's`",
        cause="ids beyond the embedding",
        do="a larger `vocab_size`, or the model's tokenizer",
        cases=(),
    ),
    Refusal(
        see="`DataError: The corpus (…) has no token cache in … and is larger than max_unprepared_mb (…)`, then the "
            "command that builds it: `lightning-2d prepare-data …`",
        cause="a large corpus without a token cache: training tokenizes only a corpus up to `max_unprepared_mb` "
              "itself, on one process while the others wait",
        do="run the command it prints (the same `--config` files and `--data` options)",
        cases=("a large corpus without a token cache",),
    ),
    Refusal(
        see="`add_bos=True needs a beginning-of-text token, but the tokenizer 'byte' has none` / "
            "`Tokenizer folder … has none of tokenizer.json, tokenizer.model`",
        cause="a BOS asked of a tokenizer without one; a folder with no tokenizer",
        do="a tokenizer with a BOS (`tokenizer.json` of the model) or `add_bos=False`; the model's folder or its "
           "tokenizer file",
        cases=("a beginning-of-text token asked of a tokenizer without one", "a tokenizer folder without a tokenizer"),
    ),
    Refusal(
        see="``… is a tiktoken BPE file (Meta's Llama 3 tokenizer.model), which needs the `tiktoken` package``",
        cause="Meta's original `tokenizer.model` without `tiktoken` installed",
        do="`pip install 'lightning-2d[tiktoken]'`, or the model's `tokenizer.json`",
        cases=("Meta's tiktoken tokenizer.model without tiktoken",),
    ),
    Refusal(
        see="`lightning-2d export: error: --tokenizer …: no such file or folder`",
        cause="an export's `--tokenizer` that does not exist (checked before anything is written)",
        do="a tokenizer file or model folder, or `byte`",
        cases=("export with a tokenizer that does not exist",),
    ),
    Refusal(
        see="`lightning-2d export: error: … is not a complete checkpoint` / `… is not a torch.save zip archive …` / "
            "`… is damaged (…distcp: N bytes …)`",
        cause="not a checkpoint, or a shard cut short",
        do="an intact checkpoint; nothing is written on failure",
        cases=(
            "export of a folder that is not a checkpoint",
            "export of a file that is not a checkpoint",
            "export of a checkpoint whose shard was cut short",
        ),
    ),
    Refusal(
        see="`CheckpointError: Checkpoint … is damaged: its bytes changed after it was saved at step N (FILE: TENSOR "
            "reads as …, saved as …)`",
        cause="a shard or file changed after saving (a disk, copy or transfer error); its digest no longer matches",
        do='an earlier checkpoint, or copy this one again; `ckpt_path="last"` takes the newest intact one',
        cases=("checkpoint whose bytes changed",),
    ),
    Refusal(
        see="`UnsafeCheckpointError: …/meta.pt holds a pickled posix.system, which a weights-only load refuses to "
            "build …: the file was not loaded`",
        cause="the checkpoint holds a pickled function or class outside tensors and plain data: written by code you "
              "should not trust, or tampered with",
        do="a checkpoint you saved; for a data class of your own, `torch.serialization.add_safe_globals([YourType])` "
           "before loading (export: `--allow-global MODULE.NAME`)",
        cases=("checkpoint holding a pickled callable",),
    ),
    Refusal(
        see="`CheckpointError: Checkpoint … is damaged (digests.json is unreadable (…)` / "
            "`… (digests.json is damaged: its content does not match its own digest …`",
        cause="the manifest itself was cut short or changed: nothing can be checked against it",
        do='an earlier checkpoint, or copy this one again; `ckpt_path="last"` takes the newest intact one',
        cases=("checkpoint whose digests.json is cut short", "checkpoint whose digests.json was edited"),
    ),
    Refusal(
        see="`LoRAConfigError: Invalid LoRA settings: rank must be a positive integer, got 0` / "
            "`Unknown LoRA setting(s) ['r']; the settings are […]` / "
            "`… quantize_base must be one of ['nf4'] or None, got 'nf8'`",
        cause="a `lora=` value out of range or a misspelled key",
        do="the fields of `lightning_2d.LoRA`: `rank`, `alpha`, `dropout`, `targets`, `rslora`, `quantize_base`",
        cases=("LoRA rank 0", "LoRA setting misspelled", "QLoRA quantization misspelled"),
    ),
    Refusal(
        see="`lora.targets ['q_porj'] match no linear layer of Transformer; its linear layers are called […]` / "
            "`LoRA adapts plain nn.Linear layers; this target is a VocabProjection`",
        cause="a target that names no projection, or the output head",
        do="one of the names listed (ours or Hugging Face's), or omit `targets` for all seven projections",
        cases=("LoRA target misspelled", "LoRA on the output head"),
    ),
    Refusal(
        see="`float8='emulate' with LoRA adapters (LlamaLightningModule(lora=...)) …`",
        cause="float8 swaps the projections for torchao's `Float8Linear`, which adapters cannot wrap",
        do="`float8=False` with `lora`",
        cases=("LoRA with float8",),
    ),
)
