"""Placement: where the experience plane's state lives (topology, cost model, planner). Re-exports only.

    topo = placement.Topology.detect()            # or placement.dgx_h100(), placement.cluster(128), Topology.load(...)
    p = placement.plan(spec, capacity, topo, placement.Workload(batch_size=256, sampler="prioritized"))
    print(p.explain())
    state = jax.device_put(state, p.shardings(config))   # config built on p.mesh()
"""

from conduit_jax.placement.cost import Costs, Placement, Workload, estimate, part_bytes, reshard_time
from conduit_jax.placement.planner import Plan, cli_main, parse_spec, part_of, plan, with_part_in
from conduit_jax.placement.topology import (MEMORY_KINDS, PRESETS, Device, Link, MemorySpace, PlacementError, Timing,
                                            Topology, cluster, dgx_h100, emulated_cpu, h200, pcie_8gpu)

__all__ = [
    "MEMORY_KINDS", "PRESETS", "Costs", "Device", "Link", "MemorySpace", "Placement", "PlacementError", "Plan",
    "Timing", "Topology", "Workload", "cli_main", "cluster", "dgx_h100", "emulated_cpu", "estimate", "h200",
    "parse_spec", "part_bytes", "part_of", "pcie_8gpu", "plan", "reshard_time", "with_part_in",
]
