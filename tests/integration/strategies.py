"""A strategy used by the integration tests (loaded by the Planner as module:function)."""

from overlord.plan.dgraph import DGraph


def balanced_broadcast_tp(data, tree):
    g = DGraph(data, tree, view="tokens").mix().broadcast_at("TP")
    g.distribute("DP").cost("attention")
    g.balance("karmarkar_karp", level="inter").balance("greedy", level="intra")
    return g.plan()


def busy_text(row):
    """The text transform, slowed to 5 ms a sample (a costly source, yet a quick test)."""
    import time

    from overlord.transforms import text

    time.sleep(0.005)
    return text(row)


def slow_text(row):
    """The text transform, slowed to 50 ms a sample (a heavy decode stand-in)."""
    import time

    from overlord.transforms import text

    time.sleep(0.05)
    return text(row)
