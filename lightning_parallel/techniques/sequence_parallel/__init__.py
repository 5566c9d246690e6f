"""Sequence parallelism (Ulysses): the ``k`` ranks of a group share each sample, ``1/k`` of its tokens each.

Every rank holds ``t = T/k`` consecutive tokens of every sample through the embeddings, MLPs, norms and
the loss; around the attention core an all-to-all turns "my tokens, all heads" into "all tokens, heads/k"
and back (DeepSpeed's Ulysses, ALST; Megatron's ``cp_comm_type="a2a"``). Pure torch, no Lightning.

The mechanics, one concern a module (phase 1 of issue 53), and the technique that wires them (phase 2):

================  =====================================================================================
``exchange``      the all-to-alls with autograd (``tokens_to_heads`` / ``heads_to_tokens``, each the
                  other's backward; a verdict column rides on the query's), ``gather_tokens``
``heads``         ``k`` must divide the query and the key/value heads: ``check_heads`` names the sizes
``masks``         causal attention carries over to every token; any other mask is refused; sliding
                  windows shorter than the sequence refused from the model's config
``attention``     ``ulysses_attention``: SDPA's arguments and result, on a shard, over the whole sequence
``eager``         ``SequenceParallelMode`` (a ``TorchFunctionMode``: SDPA -> Ulysses, the shard's
                  ``arange(t)`` -> its positions) and ``run_forwards_in`` (each forward enters it, so a
                  block recomputed in backward does too)
``graph``         ``rewrite_stage``: a traced stage's SDPA nodes and position ``arange`` nodes rewritten
``positions``     ``position_ids`` for a model that takes them, the ``arange`` offset for one that makes
                  its own (the choice, and what was weighed, in its docstring)
``labels``        ``shift_across_shards`` / ``group_labels``: a ``labels=`` loss's boundary labels
``shards``        ``shard_batch``: the batch transform (contiguous shards, right-padding masks, refusals)
``loss``          ``token_weight``: a shard's mean weighted by its share of the group's labelled tokens
``technique``     ``TECHNIQUE``: the plan field, the batch transform, the stages, the checks (the contract)
``model_checks``  what it checks in the model: the heads it declares, an attention split, ``labels=``
                  handed to a module that would shift them
``planned``       the planner's model: per-token bytes and compute ``/ k``, the all-to-alls, the
                  search's ``k``
================  =====================================================================================

Checked against one device (tests/test_sequence_parallel_exact.py, gloo): Ulysses attention bit for bit
on 2 and 4 ranks (causal, full, GQA with ``enable_gqa`` and with repeated heads); a tiny GPT eager, as a
traced stage and with recomputed blocks (loss, every gradient, one SGD step: within 1e-6); a GQA Llama with
its own ``labels=`` loss, ``-100`` prompts filling a shard, right padding; by hand (not in the suite: 16 s
of export per rank), a traced Llama stage with its materialised causal mask (gradients within 3e-8).

Integration design (for the contract of DESIGN-51; file and function names as they are today)
------------------------------------------------------------------------------------------------

**Plan.** One field, ``sequence_parallel_size: int = 1`` (``PipelineStrategy(sequence_parallel_size=k)``,
label ``sp=k``). ``devices = pipeline x replicas x k x tensor``. ``check``: a positive int; ``k=1`` is
off. Refused at first, each with the value and the fix: ``tensor_parallel_size > 1`` (both split the
heads; a traced TP stage runs on DTensors, which the all-to-all does not take: heads must then divide by
``tp x k``, later), ``compile`` (a rewritten stage's Python-callable nodes and the mode under dynamo are
unchecked; torch's functional ``all_to_all_single_autograd``, which export records, is the way there).
``variants``: ``k`` among ``heads.sizes_that_work(heads, kv_heads)`` that divide the devices left after
pipeline x tensor, where ``planner/facts.py`` knows the heads (Hugging Face configs:
``num_attention_heads``, ``num_key_value_heads``); ``None`` known: ``k=1`` only.

**Mesh** (``plan/layout.py: RankLayout``, ``pipeline/mesh.py: build_mesh``). A new axis ``sp`` between
``dp_shard`` and ``tp`` (``MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "sp", "tp")``; global rank
``((pp x dp + dp_rank) x k + sp_rank) x tp + tp_rank``: the ``k`` ranks that exchange four times per
layer are neighbours, after the tensor ranks). The roles it joins (DESIGN-51 section 4, torchtitan's
``dp_shard_cp``): **gradients** yes (averaged over dp x sp: each rank's gradient is its shard's part of
the same samples' sum), **shard** yes (FSDP2 over ``dp_shard x sp`` flattened, HSDP over
``(dp_replicate, dp_shard x sp)``; ZeRO-1 over dp x sp), **loss / item counting** yes (``ItemWindow``
over dp x sp, ``copies=1``: the shards' tokens are disjoint), **metrics** yes (token sums over the
shards), **data** no (the ``k`` ranks read the same samples: ``distributed_sampler_kwargs`` keep
``num_replicas = dp``; ``strategies/pipeline/same_data.py``'s fingerprint check extends to the sp peers),
**pipeline** no (one ``pp_group`` per (dp, sp, tp) coordinate; tied weights likewise), and a role of its
own, **sequence** (``mesh.group("sequence")``, what every module here takes as ``group``).

**Stage transform** (``stages(view, job)``, on each stage as it is prepared, re-traces included):
traced stages: ``graph.rewrite_stage(stage_module, group, positions=not takes_position_ids(target))``;
a model none of whose stages has an attention node is refused at the first batch (the counts summed
over the pipeline: a stage holding only the head has none). Sequential stages: ``eager.run_forwards_in(mode,
stage_module)`` with one ``SequenceParallelMode`` per rank, and ``mode.check_found(...)`` after the
first forward (every rank of the group raises together: same model). Heads are checked at setup from
the model's config where it has one (``check_heads``), else at the first attention call (before any
exchange, on every rank alike). Recomputation: the rewritten graph re-runs its own exchanges; for
eager stages ``sequence_parallel`` must come **before** ``recompute`` in ``TECHNIQUES`` (recompute keeps
an instance's forward, so it then recomputes the wrapped one: a block whose own body calls SDPA, as
experiments/models.py's ``Block`` does, is covered; after it, only SDPA inside a submodule is). The
technique's order is otherwise free: it touches no parameter.

**Batch transform** (a new contract member, ``batch(job) -> Callable[[batch], batch] | None``; a step
context cannot replace the batch). Applied in ``strategies/pipeline/step.py: run_step`` before
``_Step(...)`` (so ``StepMicrobatches.of``, ``call.capture``, ``loss_fn``'s chunks and the item counts
all see the shard), for training, validation and test, and in ``strategies/pipeline/call_input.py:
TrainerInput`` for the first input the sources trace at. It is ``shard_batch(batch, sp_rank, k)``, then
``masks.check_window(target, length)``, then ``mode.tokens = length // k``. Micro-batches split the
samples of the sharded batch as before.

**Call keywords** (a second member, ``call_keywords(plan, mesh, module) -> (path, kwargs) -> kwargs``,
made with ``batch`` and applied in ``pipeline/proxy.py: PipelinedCall.capture`` before the call's
keywords are bound: a traced stage never calls the model, so hooks cannot do it; the traced source hands
it to the call it makes, so the split's first input and every step see it alike): with ``labels=`` on a
model that shifts them (``labels.shifts_labels``) and no ``shift_labels``, ``shift_labels =
labels.shift_across_shards(labels, group)``. A dict batch with ``labels`` gains ``shift_labels`` in the
batch transform already (``labels.with_shift_labels``, on the whole sequence: no collective), so
``self.model(**batch)`` passes them. ``position_ids`` are given by a forward pre-hook instead
(``give_position_ids``: no collective, so it may run at replay too). Not ``num_items_in_batch``: a 0-dim
tensor, which torch's micro-batch splitter refuses (checked: ``IndexError``); the ``ItemWindow`` weights
the shards' means, and a micro-batch shard without a labelled token has a NaN mean with zero gradients
(torch 2.13, CPU) that ``pipeline/step_logs.py: weighted_mean`` already skips at weight 0.
``strategies/pipeline/items.py`` then counts ``shift_labels`` (``grads/item_weights.py:
hugging_face_count`` reads them first).

**Reductions.** None of its own: ``grads/sync.py: GradientSync`` gets ``group = mesh.group("gradients")``
and ``replicas = dp x k``. Sample-weighted steps (no item counting) average the shards' means: exact
when every position is labelled (equal counts); with ``-100`` labels the setup warns to count items
(``TokenWeightedLoss(count=labelled_tokens(...))``; automatic for a Hugging Face ``labels=`` loss).
Logged values (``step_results.replay_logs``) and torchmetrics states reduce over dp x sp; a per-sample
metric computed on shards is wrong, and is the user's to gather (said in the docs).

**Validation and prediction.** Validation and test run like training: sharded batch, each shard's
loss, logged values weighted over the group. Prediction: ``_Step.evaluate`` on the last stage gathers
the output in token order (``exchange.gather_tokens(output, group, dim=1)``) and replays
``predict_step`` on the whole batch, so its output is one device's; ``step_results.collect_predictions``
returns ``None`` on ``sp_rank > 0`` as it does on ``tp_rank > 0``. Gathered logits are ``T x vocab``
per sample on each rank of the group: the last stage's peak of prediction is one device's.

**Memory** (``memory(ledger)``): every activation a stage saves per micro-batch ``/ k`` (the tokens are
``/ k``; inside attention the saved query/key/value/output are the whole sequence for ``heads/k``:
``/ k`` too; the logits ``/ k``); plus, while one attention runs, its exchange buffers (a send and a
receive copy of query, key, value and output at ``1/k`` size: ~2x one attention input, transient);
parameters, gradients and optimizer state unchanged unless FSDP/ZeRO shard them over dp x sp (then ``/
(dp_shard x k)``). A Hugging Face model traced materialises a ``(b, 1, t, t)`` boolean causal mask per
micro-batch: ``t = T/k`` makes it ``k^2`` smaller, still ``t^2`` bytes a sample (a graph rewrite that
drops it when it is causal would remove it: later).

**Time** (``time(ledger)``): per attention layer and micro-batch, four all-to-alls in forward (q, k, v
at ``1/k`` of the attention input each, key/value at ``kv_heads/heads`` of it; output), four in backward,
four more with the block recomputed; each moves ``(k-1)/k`` of its tensor, on the sp link (neighbours:
intra-node). Compute per rank ``/ k`` (token-wise work ``/ k``, attention ``T^2 x heads/k``). The gradient
all-reduce spans dp x sp ranks (the same bytes a rank). Two tiny collectives per step with ``labels=``
(the boundary labels; the item counts join the existing one).

**Refusals** (each names the value and the fix): heads or key/value heads ``k`` does not divide (the sizes
that work); a length ``k`` does not divide (``padding_to_multiple`` / ``pad_to_multiple``); a mask that
is not causal, on any rank (left padding, packed sequences, bidirectional; raised on every rank of the
group at the same point, by the verdict column); a sliding window shorter than the sequence; an
attention that is not SDPA (``check_found``: Hugging Face ``attn_implementation='sdpa'``); a static
trace whose micro-batch size equals its shard length (``rewrite_stage``); and at plan time tensor
parallelism and ``compile`` together with ``k > 1``. Attention dropout runs (its masks differ from one
device's: not bit-exact, as with tensor parallelism).

**Files outside this folder** the integration touches: ``techniques/__init__.py`` (the entry in
``TECHNIQUES``), ``plan/parallel_plan.py`` (the field, and its share of the rank grid: ``layout()``,
the devices' check), ``strategies/pipeline/strategy.py`` (the keyword; ``options.py`` maps every plan
field onto the plan by itself), ``layout/ranks.py`` (the axis and the roles it joins; ``layout/mesh.py``
builds every axis alike). What was new in the package for it and is now every technique's: the contract's
``batch``, ``call_keywords`` and ``predictions`` (with their call sites), the role sizes the other
techniques read (``dp x k``), and the planner's ``SearchOptions.model`` and ``ModelFacts.tokens``. Its
search option (``--sequence-parallel``, ``Search(sequence_parallel=...)``) is its own
(``planned.SPLIT_SEQUENCES``, a ``SearchOption``): the planner builds the flag and the keyword from it.
The planner's sequence-length axis (``--longest``): ``planner/lengths.py`` and ``planner/longest.py``.
"""
