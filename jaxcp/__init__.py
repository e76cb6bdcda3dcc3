"""jaxcp: context parallelism for gated delta-rule linear attention (GDN, KDA) in JAX."""
from jaxcp.checks import check_traced_inputs
from jaxcp.cp.split import CP_LAYOUTS, from_layout, to_layout
from jaxcp.ops import chunk_gated_delta_rule, chunk_kda
from jaxcp.recurrent import recurrent_gated_delta_rule, recurrent_kda
from jaxcp.reference import gated_delta_rule_reference, kda_reference

__version__ = "0.1.0"
__all__ = ["CP_LAYOUTS", "check_traced_inputs", "chunk_gated_delta_rule", "chunk_kda", "from_layout",
           "gated_delta_rule_reference", "kda_reference", "recurrent_gated_delta_rule",
           "recurrent_kda", "to_layout"]
