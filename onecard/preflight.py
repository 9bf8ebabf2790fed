"""Checks on a resolved ServePlan before a multi-minute boot: refuse (PlanError) or cap (with a
reason recorded in the plan). Pure: no GPU, no vllm import.

Checks, in order:
0. MAX_LEN vs the checkpoint's max context (``geom.max_model_len``, read from its config.json the
   way vLLM 0.27.1 derives it: onecard.memory.config_max_len). vLLM refuses a longer
   --max-model-len after its config load unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 is set. A CTX
   profile's default MAX_LEN is capped to the limit (with a note); an explicit MAX_LEN (env or
   .env) is refused naming the limit and the two ways out; with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1
   in the environment it passes with a warning note.
1. TP>1 (the TP knob or -tp in EXTRA_ARGS; plan.resolve decides): TP must divide the model's
   attention, KV and GDN heads and not exceed the visible GPUs (when known); the single-card
   KV_MEM pin is dropped (an explicit byte pin is refused) and the pool is sized from GPU_UTIL;
   the prediction is per GPU (onecard.memory.predict_tp) on 24 GiB cards, with the same layers in
   the pool as at TP=1 (SPEC=dflash2: the drafter's attention layers, no MTP layer; none with
   DFLASH_RING=1), every KV / GDN head count split per rank as vLLM splits it (a drafter whose KV
   heads TP does not split is refused). Each GPU's pool is card x GPU_UTIL less step 9's terms at
   one GPU's share (_tp_vram: the target's weights as loaded, mtp.* only with SPEC=mtp; the
   DFlash2 drafter's split and replicated parts, DRAFT_QUANT=fp8; the draft head, KVarN stage,
   rings, lane, GDN_DEFER scratch; the reserves), into plan.prediction["vram"] (per_gpu) and a note.
2. ``--dtype float16`` with speculation is refused (drafters and GDN state run in bf16).
3. k > 7 (DFlash2 DFLASH_TOKENS 8..15): CUDA-graph sizes capped to multiples of 1+k and
   max_len capped to 65,536.
4. max_len vs the predicted pool: cap max_len to what one sequence can hold, refuse below 4,096.
5. MAX_SEQS vs pool blocks: vLLM raises "max_num_seqs (N) exceeds available Mamba cache blocks"
   when capturing FULL graphs (config/compilation.py); cap MAX_SEQS to num_blocks.
6. Residency note: each resident sequence holds gdn_groups x (1|2 + k) state blocks, gdn_groups x (1|2)
   with GDN_DEFER=1 (speculation only; the default on one GPU, plan.resolve's GDN_DEFER=auto;
   memory.predict_pool(gdn_defer=True)); with speculation and GDN_DEFER=0 one more note says what
   GDN_DEFER=1 would give this plan (blocks per sequence, the longest sequence, the KV_MEM pin for
   the same pool), all from predict_pool.
7. KV_MEM=auto: note that gpu_memory_utilization does not reserve CUDA-graph memory.
8. PREFIX_CACHE=1 with speculation (SPEC=mtp/dflash2: vLLM's EAGLE-style path): every prefix-cache
   hit loses its last attention block, so prompts of <= 2 x block tokens never hit; and, with a
   pool prediction, how many resent prompts the LRU cache keeps (docs/prefix-cache.md).
9. What the KV pin does not cover (onecard.memory.vram_budget): the target's weights,
   SPEC=dflash2's drafter weights (DRAFT's safetensors headers, else its config shape, else the
   published 27B drafter: 3.58 GiB bf16), SPEC=mtp's draft_lm_head of patch 0012
   (MODEL/draft_vocab.json unless ONECARD_DRAFT_VOCAB=0), CTX=huge's KVarN fp16 stage,
   DFLASH_RING=1's drafter K/V rings (memory.dflash2_ring_bytes at MAX_SEQS and DFLASH_TOKENS),
   GDN_DEFER=1's verify scratch with speculation (memory.gdn_defer_scratch_bytes at MAX_SEQS and k), the
   reserves; when a drafter / draft-head / stage / ring term is what pushes it over, the note names it.
   The card: CARD_GIB, else nvidia-smi's memory.total of the first visible GPU at a real launch
   (plan.card_memory), else a 24 GiB card as a note only (--dry-run, no nvidia-smi).
   9a (before step 4): with the card known and VRAM_CHECK=1 (default), a plan that cannot fit
   even without the estimated graph/activation reserves (weights + drafter + draft head + stage
   + KV pin + CUDA context > card) does not boot as it is: a profile's KV_MEM pin is capped to
   the largest that fits by the estimate (the pool and MAX_LEN follow from it), an explicit
   KV_MEM is refused naming that pin; VRAM_CHECK=0 makes it a note again. A plan over the card
   only by the estimated reserves keeps its pin and gets step 9's note. The DFlash2 drafter's own attention
   layers share the pool: step 4 predicts with them and its cap says so; with DFLASH_RING=1 they hold no
   pool pages (predicted without them) and a note gives their rings' bytes.
"""
from __future__ import annotations

from onecard import memory, profiles
from onecard.plan import DFLASH2_DRAFTER_ROWS, PlanError, ServePlan

MIN_POOL = 4096
K_GRAPH_LIMIT = 7
K_MAX_LEN_CAP = 65_536


def _extra(plan: ServePlan) -> list[str]:
    return list(plan.get("EXTRA_ARGS"))


def _has_flag_value(extra: list[str], flag: str, value: str) -> bool:
    for i, a in enumerate(extra):
        if a == flag and i + 1 < len(extra) and extra[i + 1] == value:
            return True
        if a == f"{flag}={value}":
            return True
    return False


def allow_long_max_len(environ) -> bool:
    """VLLM_ALLOW_LONG_MAX_MODEL_LEN as vLLM 0.27.1 reads it (envs.py: "1" or "true", any case)."""
    return str((environ or {}).get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0")).strip().lower() in ("1", "true")


def _model_max_len(plan: ServePlan, geom: memory.ModelGeometry, environ) -> None:
    """Step 0: MAX_LEN vs the checkpoint's max context (vLLM refuses a longer one at config load)."""
    limit = geom.max_model_len
    mv = plan.values["MAX_LEN"]
    n = int(mv.value)
    if limit is None or n <= limit:
        return
    where = f"{geom.max_model_len_source} in MODEL's config.json"
    if allow_long_max_len(environ):
        plan.notes.append(f"WARNING: MAX_LEN={n:,} is above the model's max context {limit:,} ({where}); "
                          f"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 lets vLLM serve it, but positions past {limit:,} "
                          f"are beyond what the model's RoPE was built for (output may degrade or turn to NaN)")
        return
    if mv.source in ("env", ".env"):
        raise PlanError(f"MAX_LEN={n} is above the model's max context {limit} ({where}); "
                        f"valid: MAX_LEN <= {limit}, or VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 in the environment "
                        f"if you know the model extrapolates past it")
    plan.cap("MAX_LEN", limit, f"model max context ({where}); {mv.reason or 'profile'} default {n:,}")
    plan.notes.append(f"MAX_LEN capped {n:,} -> {limit:,}: the {mv.reason or 'profile'} default is above the model's "
                      f"max context ({where}); set MAX_LEN <= {limit:,}, or VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 "
                      f"to keep {n:,} if the model extrapolates")


def _tp_checks(plan: ServePlan, geom: memory.ModelGeometry, tp: int) -> None:
    err = memory.tp_check(geom, tp)
    if err:
        raise PlanError(err)
    gpus = plan.values.get("GPUS")
    if gpus is not None and isinstance(gpus.value, int) and gpus.value < tp:
        fit = [str(n) for n in memory.tp_sizes_for(geom) if n <= gpus.value] or ["1"]
        raise PlanError(f"TP={tp} needs {tp} GPUs but only {gpus.value} visible ({gpus.reason}); "
                        f"valid here: TP={'|'.join(fit)}")
    kvm = plan.values["KV_MEM"]
    if kvm.value != "auto" and kvm.source in ("env", ".env"):
        raise PlanError(f"KV_MEM={kvm.value} is a per-GPU byte pin, which at TP={tp} strands memory; "
                        f"valid at TP>1: KV_MEM unset or auto (the pool is then sized from GPU_UTIL)")
    if kvm.value != "auto":
        plan.cap("KV_MEM", "auto", f"tensor parallel {tp} > 1: the single-card pin does not apply; "
                                   f"the pool is sized from GPU_UTIL={plan.get('GPU_UTIL')} per GPU")
    plan.values["GPU_UTIL"].reason = f"sizes the KV pool on each of the {tp} GPUs (TP={tp})"
    if gpus is not None and gpus.value == "unknown":
        plan.notes.append(f"TP={tp}: visible GPU count unknown ({gpus.reason}); vLLM checks it at boot")
    plan.notes.append(f"TP={tp}: vLLM's own tensor parallelism over {tp} GPUs of one host; speculative "
                      f"defaults unchanged (vLLM 0.27.1 runs the MTP/DFlash drafter at the target's TP)")
    plan.notes.append("TP>1: server env " + " ".join(f"{k}={v}" for k, v in profiles.TP_CHILD_ENV.items())
                      + " (NVLink multicast off; onecard.profiles.TP_CHILD_ENV says why)")


def _tp_weights(plan: ServePlan, geom: memory.ModelGeometry, tp: int) -> memory.TPWeights | None:
    """The target's weights per GPU: the checkpoint's safetensors headers when MODEL is on disk,
    else the prepared 27B layout when the geometry is the 27B one, else unknown (None); what the
    plan loads only, as at TP=1 (memory.target_tp_weights: mtp.* only with SPEC=mtp, no
    embed_tokens with EMBED_HOST=1)."""
    tensors, source = memory.target_tensors(str(plan.get("MODEL")), geom)
    if tensors is None:
        return None
    if plan.get("EMBED_HOST") == "1":
        source += ", embed_tokens in host memory"
    return memory.target_tp_weights(tensors, tp, source, plan.get("SPEC"), embed_host=plan.get("EMBED_HOST") == "1")


def _tp_vram(plan: ServePlan, geom: memory.ModelGeometry, tp: int, weights: memory.TPWeights,
             attn_layers: int, environ) -> tuple[dict, str]:
    """TP>1: what one GPU holds beside its KV pool, the TP=1 budget's terms (_vram) each at one
    GPU's share, as vLLM 0.27.1 splits them (the drafter runs at the target's TP):
    the target's weights (_tp_weights); SPEC=dflash2's drafter (memory.dflash_drafter_vram at tp:
    linear layers split, fc / convs / selector / norms whole, DRAFT_QUANT=fp8 on each shard);
    SPEC=mtp's draft_lm_head of patch 0012 (a ParallelLMHead: vocab rows / TP); CTX=huge's KVarN
    stage and prefill scratch (allocated per layer with the layer's own, the rank's, KV and query
    heads: kvarn_reserve_bytes at the rank's geometry); DFLASH_RING=1's rings (the rank's KV heads,
    memory.dflash2_ring_bytes at tp); the DFlash2 lookup lane's history (every rank's proposer keeps
    the whole one: counted whole); GDN_DEFER=1's verify scratch (the rank's GDN heads); the
    reserves (3090 single-card estimates; their split at TP is not known from code: whole on every
    GPU, PREFILL_CHUNK's activation growth included). Returns (memory.vram_budget at kv_pin 0,
    the terms as one line)."""
    spec = plan.get("SPEC")
    head, hsrc = 0, ""
    if spec == "mtp":
        head, hsrc = memory.draft_lm_head_bytes(str(plan.get("MODEL")), (environ or {}).get("ONECARD_DRAFT_VOCAB"))
        head = memory.cdiv(head, tp) if head else 0  # ParallelLMHead (patch 0012): vocab-parallel rows
    drafter = _drafter(plan, fp8=plan.get("DRAFT_QUANT") == "fp8", tp=tp)
    stage, ring, lane, scratch, reserves = _beside_pin(plan, geom, attn_layers, tp)
    b = memory.vram_budget(0, weights.per_gpu, drafter.weight_bytes if drafter else 0, head, stage,
                           reserves=reserves, card_bytes=memory.CARD_24G, dflash2_ring_bytes=ring,
                           dflash2_lane_bytes=lane, gdn_defer_scratch=scratch)
    b["sources"] = {"weights": weights.source, "drafter_weights": drafter.source if drafter else "",
                    "draft_lm_head": hsrc}
    parts = [f"target weights {_gib(weights.per_gpu)} ({weights.source})"]
    if drafter:
        parts.append(f"DFlash2 drafter {_gib(drafter.weight_bytes)} ({drafter.source})")
    if head:
        parts.append(f"MTP draft_lm_head {_gib(head)} ({hsrc}, / {tp})")
    if stage:
        parts.append(f"KVarN fp16 stage + prefill scratch {_gib(stage)} (MAX_SEQS={plan.get('MAX_SEQS')})")
    if ring:
        parts.append(f"DFlash2 drafter K/V rings {_gib(ring)} (DFLASH_RING=1, MAX_SEQS={plan.get('MAX_SEQS')}, "
                     f"DFLASH_TOKENS={plan.get('SPEC_K')})")
    if lane >= memory.GiB // 100:
        parts.append(f"DFlash2 lookup lane history {_gib(lane)} (whole on every GPU)")
    if scratch:
        parts.append(f"GDN_DEFER=1 verify scratch {_gib(scratch)}")
    parts.append(f"reserves {_gib(b['reserves'])} (3090 single-card estimates)")
    return b, " + ".join(parts)


def _prefix_cache_spec_note(plan: ServePlan, geom: memory.ModelGeometry, k: int) -> None:
    """vLLM 0.27.1 runs MTP and DFlash(2) as EAGLE-style drafters (SpeculativeConfig.use_eagle),
    and no KV cache group of this model is flagged as the drafter's, so every group gets the
    EAGLE drop: the full-attention lookup discards its last matched block
    (kv_cache_coordinator.py, HybridKVCacheCoordinator.find_longest_cache_hit) and the scheduler
    caches the prompt's GDN state one block earlier (scheduler.py, _mamba_block_aligned_split).
    Patch 0081 turns the drop off for DFlash (its drafter's cached K/V depend on tokens up to
    their own position only), so the note is for SPEC=mtp."""
    if plan.get("PREFIX_CACHE") != "1" or k <= 0 or plan.get("SPEC") != "mtp":
        return
    block = memory.attention_block_size(geom, plan.get("KV"), k)
    plan.notes.append(
        f"PREFIX_CACHE=1 with SPEC={plan.get('SPEC')}: vLLM 0.27.1 drops the last matched attention block of "
        f"every prefix-cache hit under speculation: a resent prompt of L tokens reuses at most "
        f"floor((L-1)/{block})*{block} - {block} tokens (block {block}, predicted), prompts of <= {2 * block:,} "
        f"tokens never hit (docs/prefix-cache.md)")


def _prefix_cache_capacity_note(plan: ServePlan, pred: memory.PoolPrediction) -> None:
    """A resent prompt hits only while its attention blocks and its GDN state block in every GDN
    group are still cached; freed blocks are evicted LRU-first, the GDN state blocks (freed during
    prefill) before the attention blocks (freed at the end)."""
    if plan.get("PREFIX_CACHE") != "1":
        return
    per = [n // pred.block_size + pred.gdn_groups for n in (4096, pred.max_len)]
    plan.notes.append(
        f"prefix cache: a cached prompt of L tokens holds floor(L/{pred.block_size}) attention blocks + "
        f"{pred.gdn_groups} GDN state blocks of the {pred.num_blocks}-block pool: about "
        f"{pred.num_blocks // per[0]} prompts of 4,096 tokens or {pred.num_blocks // per[1]} of "
        f"{pred.max_len:,} stay cached; resending more than that (LRU) hits ~nothing (docs/prefix-cache.md)")


def _gib(n: int) -> str:
    return f"{n / memory.GiB:.2f}"


def _ring(plan: ServePlan) -> bool:
    """DFLASH_RING=1 with SPEC=dflash2: the drafter's K/V in rings (plan.resolve read their
    geometry from DRAFT exactly then)."""
    return plan.ring_geometry is not None


def _drafter(plan: ServePlan, fp8: bool = False, tp: int = 1) -> memory.DrafterVRAM | None:
    """SPEC=dflash2's drafter (weights, KV layers; at tensor parallel ``tp`` one GPU's share of its
    weights); None otherwise and for the tiny drafter."""
    from onecard.plan import TINY_DRAFT

    if plan.get("SPEC") != "dflash2" or str(plan.get("DRAFT")) == TINY_DRAFT:
        return None
    return memory.dflash_drafter_vram(str(plan.get("DRAFT")), ring=_ring(plan), fp8=fp8, tp=tp)


def _pool_drafter(plan: ServePlan, drafter: memory.DrafterVRAM | None) -> memory.DrafterVRAM | None:
    """The drafter whose attention layers share the KV pool: ``drafter`` (_drafter's record), or for
    DRAFT=tiny the tiny DFlash2 drafter's shape (onecard.dflash.tiny_drafter.DEFAULT_DRAFTER, what
    ensure_tiny_drafter builds: 2 layers of 2 KV heads x 64 beside the tiny target's 2 x 256; no
    weights, the tiny model has no VRAM budget). Without it the pool was predicted with the MTP
    layer in the target's bucket instead (job 75: 241,956 / 232,886 predicted, vLLM 195,347 /
    188,100 at k 7 / 15; tests/test_pool_vs_vllm.py)."""
    from onecard.plan import TINY_DRAFT

    if drafter is not None or plan.get("SPEC") != "dflash2" or str(plan.get("DRAFT")) != TINY_DRAFT:
        return drafter
    from onecard.dflash.tiny_drafter import DEFAULT_DRAFTER as t

    return memory.DrafterVRAM(0, 0 if _ring(plan) else t.layers, "the tiny DFlash2 drafter's spec (no VRAM budget)",
                              kv_heads=t.kv_heads, head_dim=t.head_dim)


def _pool_layers(plan: ServePlan, geom: memory.ModelGeometry, drafter: memory.DrafterVRAM | None,
                 k: int) -> tuple[memory.DrafterVRAM | None, dict, int]:
    """(the drafter whose layers share the pool (_pool_drafter), predict_pool's keywords for it, the
    attention layers holding KV) at the whole model's shape; at TP>1 memory.predict_tp splits the
    drafter's KV heads per rank. SPEC=dflash2 builds no MTP layer: the drafter's own attention
    layers share the pool instead (pool_kw: mtp_in_pool False, their count and KV shape), unless
    they live in rings outside it (DFLASH_RING=1: none, also for the tiny drafter)."""
    in_pool = _pool_drafter(plan, drafter)
    pool_kw = in_pool.pool_kw() if in_pool else {}
    attn_layers = geom.num_full_attention + (in_pool.attn_layers if in_pool else (geom.mtp_layers if k > 0 else 0))
    if _ring(plan):  # also for the tiny drafter: no pool pages, and bf16 FLASH_ATTN (no KVarN stage slots)
        pool_kw = {**pool_kw, "mtp_in_pool": False, "draft_attn_layers": 0}
        attn_layers = geom.num_full_attention
    return in_pool, pool_kw, attn_layers


def _draft_quant(plan: ServePlan, geom: memory.ModelGeometry, drafter: memory.DrafterVRAM | None,
                 weights: tuple, attn_layers: int) -> memory.DrafterVRAM | None:
    """DRAFT_QUANT (SPEC=dflash2): the drafter record the rest of the preflight counts. auto ->
    fp8 exactly when the plan with a bf16 drafter does not fit the card (CARD_GIB, nvidia-smi at a
    real launch, else the 24 GiB assumption of the VRAM note), with a note; else bf16."""
    rv = plan.values["DRAFT_QUANT"]
    if drafter is None:  # the tiny drafter: no VRAM budget (an explicit fp8 still reaches the server)
        if rv.value == "auto":
            plan.set("DRAFT_QUANT", "bf16", "profile", "the tiny drafter: no VRAM budget")
        return drafter
    fp8 = memory.dflash_drafter_vram(str(plan.get("DRAFT")), ring=_ring(plan), fp8=True)
    if rv.value == "fp8":
        return fp8
    if rv.value == "bf16":
        return drafter
    b, _, _ = _vram(plan, geom, int(plan.get("KV_MEM")), drafter, weights, attn_layers)
    if b is None:
        plan.set("DRAFT_QUANT", "bf16", "profile", "auto: the target's weights are unknown (no VRAM budget)")
        return drafter
    card = _card_name(plan) + ("" if _card(plan)[1] else " (assumed: CARD_GIB unset and no nvidia-smi answer)")
    if b["fits"]:
        plan.set("DRAFT_QUANT", "bf16", "profile", f"auto: the plan fits the {card} with a bf16 drafter")
        return drafter
    saved = drafter.weight_bytes - fp8.weight_bytes
    plan.set("DRAFT_QUANT", "fp8", "profile", f"auto: with a bf16 drafter the plan needs {_gib(b['total'])} GiB "
                                               f"of the {card}")
    plan.notes.append(f"DRAFT_QUANT=auto -> fp8: with a bf16 drafter the plan needs {_gib(b['total'])} GiB of the "
                      f"{card}; FP8 weights for the drafter's fc, o_proj and MLP (quantized while it loads) save "
                      f"{_gib(saved)} GiB. The target verifies every token, so FP8 changes speed, not the output "
                      f"distribution (on the tiny model, job 70, 2026-12-05: the FP8 drafter's greedy output equalled "
                      f"SPEC=off on an H200, and its sampled output passed a chi-square test against it on an "
                      f"H100); its acceptance with the real drafter's weights is not yet "
                      f"measured (DRAFT_QUANT=bf16 keeps bf16)")
    return fp8


def _ring_bytes(plan: ServePlan, tp: int = 1) -> int:
    """DFLASH_RING=1: the drafter's K/V rings beside the pin (memory.dflash2_ring_bytes) at the
    plan's MAX_SEQS and DFLASH_TOKENS, on one GPU at tensor parallel ``tp``; 0 otherwise."""
    if not _ring(plan):
        return 0
    return memory.dflash2_ring_bytes(plan.ring_geometry, int(plan.get("MAX_SEQS")), int(plan.get("SPEC_K")), tp)


def _lane_bytes(plan: ServePlan) -> int:
    """The DFlash2 lookup lane's device history (memory.dflash2_lane_bytes) when the server
    builds one: SPEC=dflash2, LOOKUP=1, LOOKUP_LANE=device and DFLASH_TOKENS past the drafter's rows."""
    if plan.get("SPEC") != "dflash2" or plan.get("LOOKUP") != "1" or plan.get("LOOKUP_LANE") != "device":
        return 0
    k = int(plan.get("SPEC_K"))
    if k <= DFLASH2_DRAFTER_ROWS:
        return 0
    return memory.dflash2_lane_bytes(int(plan.get("MAX_SEQS")), int(plan.get("MAX_LEN")), k)


def _defer(plan: ServePlan) -> bool:
    """GDN_DEFER=1 with speculation (with SPEC=off the knob has no effect and is not sent)."""
    return plan.get("GDN_DEFER") == "1" and int(plan.get("SPEC_K")) > 0


def _defer_scratch(plan: ServePlan, geom: memory.ModelGeometry, tp: int = 1) -> int:
    """GDN_DEFER=1's verify scratch beside the pin (memory.gdn_defer_scratch_bytes) at the plan's
    MAX_SEQS and k, per GPU; 0 without GDN_DEFER=1 or speculation."""
    if not _defer(plan):
        return 0
    return memory.gdn_defer_scratch_bytes(geom, int(plan.get("MAX_SEQS")), int(plan.get("SPEC_K")), tp)


def _card(plan: ServePlan) -> tuple[int, bool]:
    """(bytes of the card the plan must fit, whether it is known): CARD_GIB or nvidia-smi's answer
    (plan.resolve), else 24 GiB as an assumption for the note."""
    v = plan.get("CARD_GIB") if "CARD_GIB" in plan.values else ""
    if v in ("", None):
        return memory.CARD_24G, False
    return int(float(v) * memory.GiB), True


def _weights(plan: ServePlan, geom: memory.ModelGeometry, environ) -> tuple:
    """(target weight bytes, source, MTP draft_lm_head bytes, source, the target's embed_tokens
    bytes): read once per plan (the checkpoint's safetensors headers, MODEL/draft_vocab.json) for
    steps 9a and 9."""
    model = str(plan.get("MODEL"))
    tensors, source = memory.target_tensors(model, geom)
    weights, wsrc = memory.target_weights(tensors, source, plan.get("SPEC"), embed_host=plan.get("EMBED_HOST") == "1")
    head, hsrc = (0, "")
    if weights is not None and plan.get("SPEC") == "mtp":
        head, hsrc = memory.draft_lm_head_bytes(model, (environ or {}).get("ONECARD_DRAFT_VOCAB"))
    return weights, wsrc, head, hsrc, memory.target_embed_bytes(tensors)


def _beside_pin(plan: ServePlan, geom: memory.ModelGeometry, attn_layers: int,
                tp: int = 1) -> tuple[int, int, int, int, int]:
    """The terms one GPU holds beside the KV pool and the weights, at tensor parallel ``tp``
    (_vram's at 1, _tp_vram's above): CTX=huge's KVarN fp16 stage and prefill scratch (at the
    rank's heads), DFLASH_RING=1's rings, the DFlash2 lookup lane's history, GDN_DEFER=1's verify
    scratch, and the reserves: as measured for this profile (_reserves), else estimated at the
    plan's prefill chunk."""
    kv = str(plan.get("KV"))
    stage = 0
    if memory.kvarn_preset(kv) is not None:
        stage = memory.kvarn_reserve_bytes(memory.rank_geometry(geom, tp) if tp > 1 else geom, kv,
                                           int(plan.get("MAX_SEQS")), attn_layers,
                                           int(plan.get("KVARN_WINDOW")) if "KVARN_WINDOW" in plan.values else None,
                                           int(plan.get("KVARN_SINKS")) if "KVARN_SINKS" in plan.values else None)
    return (stage, _ring_bytes(plan, tp), _lane_bytes(plan), _defer_scratch(plan, geom, tp),
            _reserves(plan, tp) or memory.reserves(_chunk(plan)))


def _reserve_key(plan: ServePlan) -> tuple:
    """The plan's key into memory.RESERVES_MEASURED: what sizes its graph / activation / sampler
    reserves (CTX, SPEC, SPEC_K, MAX_SEQS, GDN_DEFER, PREFILL_CHUNK, DRAFT_QUANT, DFLASH_RING)."""
    return (str(plan.get("CTX")), str(plan.get("SPEC")), int(plan.get("SPEC_K")), int(plan.get("MAX_SEQS")),
            str(plan.get("GDN_DEFER")), _chunk(plan), str(plan.get("DRAFT_QUANT")), "1" if _ring(plan) else "0")


def _reserves(plan: ServePlan, tp: int = 1) -> int | None:
    """The reserves job 41 measured for exactly this profile (memory.RESERVES_MEASURED), on one
    GPU; None where none was measured (the estimate, memory.reserves, applies)."""
    if tp != 1:
        return None
    return memory.RESERVES_MEASURED.get(_reserve_key(plan))


def _vram(plan: ServePlan, geom: memory.ModelGeometry, kv_mem: int, drafter: memory.DrafterVRAM | None,
          weights: tuple, attn_layers: int) -> tuple[dict | None, str, dict]:
    """Everything one GPU holds at the KV_MEM pin, against the card: (budget, the sum as one line,
    the drafter / draft-head / stage terms by name); budget None when the target's weights are
    unknown (the line then says why). ``weights``: _weights(). The budget's "certain" is its
    total without the estimated CUDA-graph and activation reserves (the CUDA context stays)."""
    weights, wsrc, head, hsrc, _ = weights
    if weights is None:
        return None, f"target weights {wsrc}", {}
    stage, ring, lane, scratch, reserves = _beside_pin(plan, geom, attn_layers)
    card, _ = _card(plan)
    b = memory.vram_budget(kv_mem, weights, drafter.weight_bytes if drafter else 0, head, stage, card_bytes=card,
                           dflash2_ring_bytes=ring, dflash2_lane_bytes=lane, reserves=reserves,
                           gdn_defer_scratch=scratch)
    b["certain"] = b["total"] - b["reserves"] + memory.CUDA_CONTEXT
    b["sources"] = {"weights": wsrc, "drafter_weights": drafter.source if drafter else "",
                    "draft_lm_head": hsrc}
    parts = [f"weights {_gib(weights)} ({wsrc})"]
    added = {}
    if drafter:
        parts.append(f"DFlash2 drafter {_gib(drafter.weight_bytes)} ({drafter.source})")
        added["the DFlash2 drafter's weights"] = drafter.weight_bytes
    if head:
        parts.append(f"MTP draft_lm_head {_gib(head)} ({hsrc})")
        added["the MTP draft_lm_head (ONECARD_DRAFT_VOCAB=0 drops it)"] = head
    if stage:
        parts.append(f"KVarN fp16 stage + prefill scratch {_gib(stage)} (MAX_SEQS={plan.get('MAX_SEQS')})")
        added["the KVarN fp16 stage and prefill scratch"] = stage
    if ring:
        parts.append(f"DFlash2 drafter K/V rings {_gib(ring)} (DFLASH_RING=1, MAX_SEQS={plan.get('MAX_SEQS')}, "
                     f"DFLASH_TOKENS={plan.get('SPEC_K')})")
        added["the DFlash2 drafter's K/V rings"] = ring
    if lane >= memory.GiB // 100:  # counted always; named once it shows at two decimals
        parts.append(f"DFlash2 lookup lane history {_gib(lane)} (LOOKUP_LANE=device, MAX_SEQS={plan.get('MAX_SEQS')}, "
                     f"MAX_LEN={plan.get('MAX_LEN')})")
        added["the DFlash2 lookup lane's token history"] = lane
    if scratch:  # the user's choice: named always, even below 0.01 GiB
        parts.append(f"GDN_DEFER=1 verify scratch {_gib(scratch)} ({geom.num_gdn} GDN layers x MAX_SEQS="
                     f"{plan.get('MAX_SEQS')} x {1 + int(plan.get('SPEC_K'))} positions)")
        added["the GDN_DEFER=1 verify scratch"] = scratch
    measured = " (" + memory.RESERVES_MEASURED_WHERE + ")" if _reserves(plan) else ""
    parts += [f"reserves {_gib(b['reserves'])}{measured}", f"KV pin {_gib(kv_mem)}"]
    return b, f"{' + '.join(parts)} = {_gib(b['total'])} GiB", added


def _card_name(plan: ServePlan) -> str:
    card, known = _card(plan)
    gib = card / memory.GiB
    name = f"{gib:.0f}" if abs(gib - round(gib)) < 0.005 else f"{gib:.2f}"
    if known and _in_use(plan):
        return f"{name} GiB card (what other processes leave of this GPU, nvidia-smi)"
    return f"{name} GiB card" + ("" if not known else
                                 " (nvidia-smi)" if plan.values["CARD_GIB"].source == "nvidia-smi" else " (CARD_GIB)")


def _in_use(plan: ServePlan) -> bool:
    """The card size is what other processes left of the GPU at launch (plan.card_for_plan)."""
    return plan.card_used_by_others > 0 and plan.values["CARD_GIB"].source == "nvidia-smi"


def _fit_card(plan: ServePlan, geom: memory.ModelGeometry, drafter: memory.DrafterVRAM | None,
              weights: tuple, attn_layers: int) -> None:
    """Step 9a, before the pool is sized: with the card known (CARD_GIB, or nvidia-smi at a real
    launch) and VRAM_CHECK=1, a plan that cannot fit does not boot as it is: a profile's KV_MEM
    pin is lowered to the largest that fits by the estimate (the pool and MAX_LEN follow), an
    explicit KV_MEM is refused, naming that pin. "Cannot fit" counts only what is certain: the
    weights, a drafter, the draft head, KVarN's stage, the KV pin and the CUDA context
    (memory.CUDA_CONTEXT). The CUDA-graph and activation reserves are estimates (the H200 logged
    0.11-0.17 GiB of graphs for the 27B at CTX=long against the 0.75 GiB reserved, and nothing
    has measured the activation peak), so a plan over the card only because of them keeps its
    pin and gets step 9's note, which names the pin that fits by the estimate."""
    _, known = _card(plan)
    if not known or plan.get("VRAM_CHECK") != "1" or str(plan.get("MODEL")) == "tiny":
        return
    kv_mem = int(plan.get("KV_MEM"))
    b, line, _ = _vram(plan, geom, kv_mem, drafter, weights, attn_layers)
    if b is None or b["fits"]:
        return
    if b["certain"] <= b["card_bytes"]:
        return  # over only by the estimated reserves: step 9's note says so
    card = _card_name(plan)
    line += f"; without the estimated graph/activation reserves still {_gib(b['certain'])} GiB"
    kv_max = b["kv_max"] // memory.MiB * memory.MiB
    if kv_max <= 0:
        free = "the GPU freed of the other processes (a server still running?), " if _in_use(plan) else ""
        raise PlanError(f"the plan does not fit the {card} even without a KV pool ({line}); valid: {free}a larger "
                        f"card, SPEC=off|mtp (no drafter), or VRAM_CHECK=0 to boot anyway")
    if plan.values["KV_MEM"].source != "profile":
        raise PlanError(f"KV_MEM={kv_mem} does not fit the {card} ({line}); valid: KV_MEM <= "
                        f"{kv_max // memory.MiB}M, or VRAM_CHECK=0 to boot anyway (the reserves are estimates)")
    plan.cap("KV_MEM", kv_max, f"the profile's pin {_gib(kv_mem)} GiB does not fit the {card} ({line}); "
                               f"the largest pin that fits (VRAM_CHECK=0 keeps the pin)")


def _budget(plan: ServePlan, geom: memory.ModelGeometry, kv_mem: int, drafter: memory.DrafterVRAM | None,
            weights: tuple, attn_layers: int) -> None:
    """Step 9: the VRAM beside the KV pin, into plan.prediction["vram"] and one note."""
    if str(plan.get("MODEL")) == "tiny":
        return
    b, line, added = _vram(plan, geom, kv_mem, drafter, weights, attn_layers)
    if b is None:
        plan.notes.append(f"VRAM beside the KV pin not predicted: {line}")
        return
    plan.prediction["vram"] = b
    embed = plan.prediction["embed_bytes"] = weights[4]
    card = _card_name(plan)
    line = f"VRAM on one GPU: {line}"
    if b["fits"]:
        plan.notes.append(f"{line}: fits a {card}")
        return
    # blame the fewest added terms, largest first, whose absence makes the plan fit (a 32 MB
    # GDN_DEFER scratch is not named beside a 2 GiB drafter that alone decides it)
    blamed, without = {}, b["total"]
    for name, size in sorted(added.items(), key=lambda kv: -kv[1]):
        if without <= b["card_bytes"]:
            break
        blamed[name], without = size, without - size
    added = blamed
    if added and without <= b["card_bytes"]:
        why = (f"does NOT fit a {card} because of {' and '.join(added)} "
               f"(without {'them' if len(added) > 1 else 'it'}: {_gib(without)} GiB, which fits)")
    else:
        why = f"does NOT fit a {card}"
    fix = (f"valid on this card: KV_MEM <= {b['kv_max'] // memory.MiB}M" if b["kv_max"] > 0
           else f"the other terms alone exceed a {card}")
    if plan.get("EMBED_HOST") == "0" and embed and b["total"] - embed <= b["card_bytes"]:
        fix += (f"; or EMBED_HOST=1 (embed_tokens in pinned host memory: {_gib(embed)} GiB less, "
                f"{_gib(b['total'] - embed)} GiB; not yet run on a GPU)")
    if _card(plan)[1] and b["certain"] <= b["card_bytes"]:
        fix += (f"; without the estimated graph/activation reserves it is {_gib(b['certain'])} GiB, so the pin "
                f"stays: if the boot runs out of GPU memory, set that KV_MEM")
    alt = plan.prediction.get("gdn_defer") or {}
    pin = alt.get("kv_mem_same_pool")
    if pin and (total := b["total"] - (kv_mem - pin) + alt["scratch_bytes"]) <= b["card_bytes"]:
        fix += (f"; or GDN_DEFER=1 with KV_MEM={pin // memory.MiB}M (the same {plan.prediction['pool_tokens']:,}-token "
                f"pool, no GDN state per draft position: {_gib(total)} GiB; the default with speculation on one GPU)")
    est = "measured on an H100" if _reserves(plan) else "3090 estimates"
    plan.notes.append(f"{line}: {why}; {fix} (or use a larger card; the reserves are {est})")


def _running(plan: ServePlan, k: int) -> dict:
    """PoolPrediction.one_sequence_tokens' keywords for a sequence that runs, not only boots: the
    plan's prefill chunk and the slots a step reserves past the last token (k drafts with SPEC=mtp,
    k + 1 with SPEC=dflash2, whose block carries the bonus position; none without speculation)."""
    spec = plan.get("SPEC")
    return {"chunk": _chunk(plan), "lookahead": k + 1 if spec == "dflash2" else (k if spec == "mtp" else 0)}


def _chunk(plan: ServePlan) -> int:
    """The plan's prefill chunk (PREFILL_CHUNK; memory.PREFILL_CHUNK in plans made without it)."""
    return int(plan.get("PREFILL_CHUNK")) if "PREFILL_CHUNK" in plan.values else memory.PREFILL_CHUNK


def _ring_note(plan: ServePlan) -> None:
    """DFLASH_RING=1: the rings into plan.prediction["dflash2_ring_bytes"] and one note (also for the
    tiny drafter, whose VRAM budget is not predicted)."""
    if not _ring(plan):
        return
    from onecard.dflash import ring as dring

    rd = plan.ring_geometry
    seqs, k = int(plan.get("MAX_SEQS")), int(plan.get("SPEC_K"))
    nbytes = _ring_bytes(plan)
    plan.prediction["dflash2_ring_bytes"] = nbytes
    plan.notes.append(
        f"DFLASH_RING=1: the DFlash2 drafter's {rd.layers} attention layers keep no KV in the pool (predicted "
        f"without them); their K/V live in bf16 rings beside the KV pin: {rd.layers} layers x "
        f"{dring.ring_total_blocks(seqs, rd.window, k)} blocks of {dring.RING_BLOCK} rows (MAX_SEQS={seqs} slots "
        f"of window {rd.window} + DFLASH_TOKENS {k} + 1, + 1 spare) x {rd.kv_heads} x {rd.head_dim} x K,V = "
        f"{nbytes:,} B ({nbytes / 1e6:.1f} MB); " + (
            "run on an H100 with CTX=huge (2026-12-05: the 27B geometry's boot, a 122,880-token prefill and a batch, "
            "job 41; output equal to SPEC=off on the tiny model, job 63)" if plan.get("CTX") == "huge"
            else f"with CTX={plan.get('CTX')} not yet run on a GPU"))


def _gdn_defer_note(plan: ServePlan, geom: memory.ModelGeometry, pred: memory.PoolPrediction, k: int,
                    prefix: bool, pool_kw: dict, tp: int = 1, want_len: int | None = None) -> None:
    """With speculation and GDN_DEFER=0: one line on what GDN_DEFER=1 would give this plan, from
    memory.predict_pool at the same pool bytes (``geom`` and ``pool_kw`` as the plan's own
    prediction; at TP>1 a rank's geometry): the GDN state blocks per resident sequence, the longest
    sequence the pool holds alone (and the MAX_LEN it would allow, when the pool capped ``want_len``,
    the MAX_LEN before that cap), and (with a KV_MEM pin) how much lower a pin gives the same pool
    (memory.kv_mem_for_pool: vLLM's logged pool at the same MAX_LEN); its verify scratch. The figures
    go into plan.prediction["gdn_defer"] (step 9's does-not-fit note and ./verify.sh's plan check
    name that pin). On one GPU GDN_DEFER=1 is the default with speculation (GDN_DEFER=auto; exact
    against SPEC=off on an H100, jobs 75 and 31), so the note comes with an explicit GDN_DEFER=0; at
    TP>1 auto is 0 and the note says GDN_DEFER=1 has not run on two GPUs. At TP>1 with GDN_DEFER=1 the
    note says what it holds instead (that path has no residency note of its own)."""
    if k <= 0:
        return
    seqs = int(plan.get("MAX_SEQS"))
    scratch = memory.gdn_defer_scratch_bytes(geom, seqs, k)  # geom: a rank's at TP>1
    where = " on each GPU, out of what GPU_UTIL leaves for the pool" if tp > 1 else " beside the KV pin"
    if plan.get("GDN_DEFER") == "1":
        if tp > 1:
            plan.notes.append(
                f"GDN_DEFER=1 (not yet run on two GPUs): each resident sequence holds {pred.state_slots_per_seq} GDN "
                f"state blocks ({pred.gdn_groups} groups x {2 if prefix else 1}; "
                f"{pred.gdn_groups * memory.gdn_state_blocks_per_group(k, prefix)} without it); its verify scratch "
                f"takes {scratch / 1e6:.1f} MB{where}")
        return
    kw = {**pool_kw, "gdn_defer": True}
    alt = memory.predict_pool(geom, pred.kv_mem_bytes, pred.kv, pred.max_len, k, prefix, **kw)
    run = _running(plan, k)  # as the MAX_LEN cap counts
    now_seq, alt_seq = pred.one_sequence_tokens(**run), alt.one_sequence_tokens(**run)
    status = "available, not yet run on two GPUs" if tp > 1 else "the default with speculation on one GPU"
    line = (f"GDN_DEFER=1 ({status}) would hold {alt.state_slots_per_seq} instead of "
            f"{pred.state_slots_per_seq} GDN state blocks per resident sequence: one sequence "
            f"{alt_seq:,} instead of {now_seq:,} tokens (+{alt_seq - now_seq:,}")
    if want_len is not None and pred.max_len < want_len:
        alt_len = want_len if alt_seq >= want_len else alt_seq // 256 * 256 or alt_seq
        if alt_len > pred.max_len:
            line += f"; MAX_LEN {alt_len:,} instead of {pred.max_len:,}"
    line += ")"
    record = {"state_slots_per_seq": alt.state_slots_per_seq, "one_sequence_tokens": alt_seq,
              "pool_tokens": alt.pool_tokens, "scratch_bytes": scratch, "kv_mem_same_pool": None}
    if tp == 1:
        pin = memory.kv_mem_for_pool(geom, pred.pool_tokens, pred.kv, pred.max_len, k, prefix, **kw)
        if pin < pred.kv_mem_bytes:
            record["kv_mem_same_pool"] = pin
            line += (f", or KV_MEM {_gib(pred.kv_mem_bytes - pin)} GiB lower for the same {pred.pool_tokens:,}-token "
                     f"pool (KV_MEM={pin // memory.MiB}M)")
    plan.prediction["gdn_defer"] = record
    plan.notes.append(f"{line}; its verify scratch takes {scratch / 1e6:.1f} MB{where}")


def run_checks(plan: ServePlan, geom: memory.ModelGeometry = memory.QWEN38_27B, environ=None) -> ServePlan:
    """``environ``: the launch environment (ONECARD_DRAFT_VOCAB, read by patch 0012 in the server)."""
    import dataclasses

    extra = _extra(plan)
    k = int(plan.get("SPEC_K"))
    if plan.get("SSM_DTYPE") != "auto":
        geom = dataclasses.replace(geom, ssm_state_bytes=4 if plan.get("SSM_DTYPE") == "float32" else 2)
    # 0. MAX_LEN vs the model's max context
    _model_max_len(plan, geom, environ)
    # 1. TP > 1 (decided once, in plan.resolve)
    tp = int(plan.get("TP")) if "TP" in plan.values else 1
    if tp > 1:
        _tp_checks(plan, geom, tp)
    # 2. fp16 + speculation
    if k > 0 and (_has_flag_value(extra, "--dtype", "float16") or _has_flag_value(extra, "--dtype", "half")):
        raise PlanError("--dtype float16 with speculation is refused (drafter/GDN state need bf16); "
                        "valid: SPEC=off with float16, or drop --dtype")
    # 3. k > 7
    if k > K_GRAPH_LIMIT:
        seqs = int(plan.get("MAX_SEQS"))
        sizes = [(1 + k) * n for n in (1, 2, 4, 8) if n <= seqs]
        plan.set("CUDAGRAPH_SIZES", sizes, "cap", f"k={k} > {K_GRAPH_LIMIT}: graphs only for verify batches of {1 + k}")
        if int(plan.get("MAX_LEN")) > K_MAX_LEN_CAP:
            plan.cap("MAX_LEN", K_MAX_LEN_CAP, f"k={k} > {K_GRAPH_LIMIT}: verify batches of {1 + k} tokens")
    # 8a. prefix cache under speculation (needs only the block size)
    _prefix_cache_spec_note(plan, geom, k)
    # 4-6. pool
    kv_mem = plan.get("KV_MEM")
    if plan.get("DRAFT_QUANT") == "auto" and (tp > 1 or kv_mem == "auto"):
        plan.set("DRAFT_QUANT", "bf16", "profile", f"auto with {'TP>1' if tp > 1 else 'KV_MEM=auto'}: no "
                                                   f"single-card fit is predicted")
    if tp > 1:
        # the DFlash2 drafter's layers in the pool (none with DFLASH_RING=1; no MTP layer) as at TP=1,
        # their KV heads split per rank (memory.rank_pool_kw, inside predict_tp)
        _, pool_kw, attn_layers = _pool_layers(plan, geom, _drafter(plan), k)
        try:
            rank_kw = memory.rank_pool_kw(pool_kw, tp)
        except ValueError as e:
            raise PlanError(f"{e}; valid: TP=1 with this DRAFT, or SPEC=mtp|off") from None
        weights = _tp_weights(plan, geom, tp)
        if weights is None:
            plan.notes.append(f"TP={tp}: no per-GPU prediction (no checkpoint at MODEL={plan.get('MODEL')} "
                              f"and not the 27B geometry)")
            return plan
        prefix = plan.get("PREFIX_CACHE") == "1"
        util = float(plan.get("GPU_UTIL"))
        # what GPU_UTIL leaves for the pool on each GPU: card x util less every term the TP=1 budget
        # counts beside the pin, at one GPU's share (_tp_vram); with the target's weights alone this is
        # memory.kv_mem_from_util. Terms vLLM allocates after its memory profile (the DFLASH_RING=1
        # rings, in the proposer's initialize_attn_backend) do not shrink the pool vLLM sizes itself:
        # counting them keeps the prediction on the safe side of the GPU_UTIL budget.
        b, line = _tp_vram(plan, geom, tp, weights, attn_layers, environ)
        kv_gpu = max(int(memory.CARD_24G * util) - b["total"], 0)
        pred = memory.predict_tp(geom, tp, weights, plan.get("KV"), int(plan.get("MAX_LEN")), k, prefix, util,
                                 kv_bytes_per_gpu=kv_gpu, gdn_defer=_defer(plan), **pool_kw)
        plan.prediction = pred.as_dict()
        b.update(kv_pin=kv_gpu, total=b["total"] + kv_gpu, per_gpu=True)
        b["fits"] = b["total"] <= b["card_bytes"]
        b["certain"] = b["total"] - b["reserves"] + memory.CUDA_CONTEXT  # as _vram's (verify.py reads it)
        plan.prediction["vram"] = b
        if b["gdn_defer_scratch"]:
            plan.prediction["gdn_defer_scratch_bytes"] = b["gdn_defer_scratch"]
        if b["dflash2_ring_bytes"]:
            plan.prediction["dflash2_ring_bytes"] = b["dflash2_ring_bytes"]
        plan.notes.append(f"TP={tp}: per GPU, GPU_UTIL {util} x {memory.CARD_24G // memory.GiB} GiB = "
                          f"{_gib(int(memory.CARD_24G * util))} GiB: {line}; the KV pool gets the rest, "
                          f"{_gib(kv_gpu)} GiB")
        _gdn_defer_note(plan, memory.rank_geometry(geom, tp), pred.pool, k, prefix, rank_kw, tp=tp)
        one_seq = pred.pool.one_sequence_tokens(**_running(plan, k))
        if one_seq < int(plan.get("MAX_LEN")):
            plan.notes.append(f"TP={tp}: on {memory.CARD_24G // memory.GiB} GiB cards the predicted pool holds "
                              f"{max(one_seq, 0):,} tokens for one sequence (< MAX_LEN {int(plan.get('MAX_LEN')):,}); "
                              f"vLLM refuses that at boot unless the cards are larger: lower MAX_LEN or raise GPU_UTIL")
        return plan
    if kv_mem == "auto":
        plan.notes.append("KV_MEM=auto: gpu_memory_utilization does not reserve CUDA-graph memory; "
                          "pin KV_MEM for a 24 GB card")
        return plan
    prefix = plan.get("PREFIX_CACHE") == "1"
    max_len = int(plan.get("MAX_LEN"))
    drafter = _drafter(plan)
    # DFlash2: no MTP layer is built; the drafter's own attention layers share the pool instead,
    # unless they live in rings outside it (DFLASH_RING=1: attn_layers 0); the tiny drafter too
    in_pool, pool_kw, attn_layers = _pool_layers(plan, geom, drafter, k)
    # 9a. the card, when known: a profile pin that does not fit is lowered before the pool is sized
    weights = _weights(plan, geom, environ) if str(plan.get("MODEL")) != "tiny" else (None, "", 0, "", 0)
    drafter = _draft_quant(plan, geom, drafter, weights, attn_layers)
    _fit_card(plan, geom, drafter, weights, attn_layers)
    kv_mem = plan.get("KV_MEM")
    defer = _defer(plan)
    pool_kw = {**pool_kw, "gdn_defer": defer}
    pred = memory.predict_pool(geom, int(kv_mem), plan.get("KV"), max_len, k, prefix, **pool_kw)
    # the longest sequence that runs alone without vLLM preempting it (async scheduling's in-flight
    # state block per GDN group, the null block, the step's lookahead slots), not only what vLLM's
    # start-up check admits: a MAX_LEN prompt must not preempt itself
    run_kw = _running(plan, k)
    one_seq = pred.one_sequence_tokens(**run_kw)
    if one_seq < MIN_POOL:
        if plan.values["KV_MEM"].source == "cap":
            raise PlanError(f"on the {_card_name(plan)} the KV pin that fits, {kv_mem // memory.MiB}M, gives a pool "
                            f"of {max(one_seq, 0):,} tokens (< {MIN_POOL:,}); valid: a larger card, SPEC=off|mtp, "
                            f"or VRAM_CHECK=0 to keep the profile's pin")
        least = memory.kv_mem_for_pool(geom, MIN_POOL, plan.get("KV"), MIN_POOL, k, prefix, **pool_kw)
        raise PlanError(f"KV_MEM={kv_mem} gives a pool of {max(one_seq, 0):,} tokens (< {MIN_POOL:,}); "
                        f"valid: KV_MEM >= {least:,}")
    if one_seq < max_len:
        capped = one_seq // 256 * 256 or one_seq
        why = f"predicted pool runs one sequence of {one_seq:,} tokens without preempting it (< {max_len:,})"
        admitted = pred.one_sequence_tokens()
        if admitted >= max_len:
            why += (f"; vLLM's start-up check would admit {admitted:,}, but under async scheduling a sequence also "
                    f"holds one more GDN state block per group ({pred.gdn_groups}) while a step is in flight, the "
                    f"pool's null block and {run_kw['lookahead']} lookahead slot(s): longer prompts fill the pool "
                    f"and vLLM preempts them, re-prefilling (vLLM 0.27.1's schedulers on the CPU, 2026-12-05)")
        if in_pool and in_pool.attn_layers:
            bare = memory.predict_pool(geom, int(kv_mem), plan.get("KV"), max_len, k, prefix, mtp_in_pool=False,
                                       gdn_defer=defer)
            bare_seq = bare.one_sequence_tokens(**run_kw)
            why += (f"; the DFlash2 drafter's {in_pool.attn_layers} attention layers hold KV in the same pool, in "
                    f"KV-cache groups of {pred.group_size} layers (without them {bare.group_size}; "
                    f"{bare_seq:,} tokens" + (", which would fit MAX_LEN)" if bare_seq >= max_len else ")")
                    + ("; DFLASH_RING=1 keeps them out of the pool (their K/V in rings of the drafter's sliding "
                       "window beside the pin; booted on a GPU with CTX=huge, H100 2026-12-05; not yet with CTX=fast|long)"
                       if plan.get("SPEC") == "dflash2" and plan.get("DFLASH_RING") == "0" else ""))
        plan.cap("MAX_LEN", capped, why)
        pred = memory.predict_pool(geom, int(kv_mem), plan.get("KV"), capped, k, prefix, **pool_kw)
    if int(plan.get("MAX_SEQS")) > pred.num_blocks:
        plan.cap("MAX_SEQS", pred.num_blocks,
                 f"vLLM refuses max_num_seqs > Mamba cache blocks ({pred.num_blocks}) with FULL graphs")
    plan.prediction = pred.as_dict()
    if defer:
        plan.prediction["gdn_defer_scratch_bytes"] = _defer_scratch(plan, geom)
    _ring_note(plan)
    resident_full = int(pred.max_concurrency)
    resident_short = pred.num_blocks // (pred.state_slots_per_seq + 1)
    if int(plan.get("MAX_SEQS")) > resident_short:
        plan.notes.append(f"MAX_SEQS={plan.get('MAX_SEQS')} > {resident_short}: even short requests beyond "
                          f"{resident_short} wait for GDN state blocks (the pool has {pred.num_blocks} blocks)")
    per_group = (f"{(2 if prefix else 1)}, from GDN_DEFER=1: no state per draft position; "
                 f"{pred.gdn_groups * memory.gdn_state_blocks_per_group(k, prefix)} without it" if defer
                 else f"{(2 if prefix else 1)}+{k}")
    plan.notes.append(
        f"each resident sequence holds {pred.state_slots_per_seq} GDN state blocks ({pred.gdn_groups} groups x "
        f"{per_group}); MAX_SEQS={plan.get('MAX_SEQS')} admits, the pool decides residency "
        f"({resident_full} sequence(s) at full {pred.max_len:,} context)")
    _gdn_defer_note(plan, geom, pred, k, prefix, pool_kw, want_len=max_len)
    # 9. VRAM beside the pin
    _budget(plan, geom, int(kv_mem), drafter, weights, attn_layers)
    # 8b. how many resent prompts the prefix cache keeps
    _prefix_cache_capacity_note(plan, pred)
    return plan
