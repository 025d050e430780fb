"""Shipped orchestration strategies (name one with `Job.strategy: module:function`).

A strategy takes the step's data and the trainer tree and returns `DGraph.plan()`:

- `vanilla`: mix, then deal samples to DP groups and micro-batches round robin, as
  per-rank DataLoaders would. No balancing.
- `balanced` (the paper's long-short LLM strategy, Figure 9): attention cost model,
  Karmarkar-Karp over DP groups, greedy bin packing over micro-batches.
- `vlm_hybrid`: the vision encoder's cost (image patches) and the backbone's
  (tokens) priced together and balanced over DP groups and micro-batches, for a model
  that encodes a sample's images on the rank that trains its tokens.
- `vlm_encoder_world` (the paper's two-module VLM strategy): images balanced over every
  rank (the encoder is data-parallel over WORLD) by patch cost, tokens balanced over DP
  groups by attention cost. Each rank receives the images it encodes with their
  destinations (DP group, micro-batch, document) for the exchange of embeddings.
"""

from __future__ import annotations

from overlord.plan.cost import encoder_cost, transformer_cost
from overlord.plan.dgraph import DGraph, Planned, StepData
from overlord.plan.tree import ClientPlaceTree


def vanilla(data: StepData, tree: ClientPlaceTree) -> Planned:
    return DGraph(data, tree).mix().distribute("DP").plan()


def balanced(data: StepData, tree: ClientPlaceTree) -> Planned:
    g = DGraph(data, tree, view="tokens").mix()
    g.distribute("DP").cost("attention")
    g.balance("karmarkar_karp", level="inter").balance("greedy", level="intra")
    return g.plan()


def vlm_hybrid(data: StepData, tree: ClientPlaceTree) -> Planned:
    g = DGraph(data, tree, view="tokens").mix()
    items = g.selected
    g.distribute("DP").cost(lambda tokens: transformer_cost(tokens) + encoder_cost(items["patches"]))
    g.balance("karmarkar_karp", level="inter").balance("greedy", level="intra")
    return g.plan()


def vlm_encoder_world(data: StepData, tree: ClientPlaceTree) -> Planned:
    g = DGraph(data, tree, view="tokens").mix()
    images = g.view("patches").distribute("WORLD").cost("patches").balance("karmarkar_karp")
    g.distribute("DP").cost("attention")
    g.balance("karmarkar_karp", level="inter").balance("greedy", level="intra")
    return g.plan(encoder=images)


__all__ = ["balanced", "vanilla", "vlm_encoder_world", "vlm_hybrid"]
