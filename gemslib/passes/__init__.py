"""Graph passes: ``torch.compile(model, backend="gemslib")`` is inductor with gemslib's fusions
run after its own post-grad passes.

    model = torch.compile(model, backend="gemslib")
    model = torch.compile(model, backend="gemslib", options={"gemslib.attention": False})
    gemslib.fusion_report()        # {fusion: sites replaced} over the graphs compiled so far

One module per fusion family declares its patterns and rewrites (``norms``, ``rotary``,
``attention``, ``linear``, ``activations``); ``forms`` holds the forms several of them match
and the graph helpers, ``base`` the declarations, ``manager`` the pass and the report,
``backend`` the torch.compile backend. The passes import the operators, never the reverse.
``PASSES`` is the pass with the default options, for an inductor config of one's own:

    torch._inductor.config.post_grad_custom_post_pass = gemslib.passes.PASSES
"""

from gemslib.passes.base import GraphPattern, GraphRewrite
from gemslib.passes.manager import PASSES, GemslibPasses, fusion_report, reset_fusion_report
from gemslib.passes.backend import backend

__all__ = ["PASSES", "GemslibPasses", "backend", "fusion_report", "reset_fusion_report",
           "GraphPattern", "GraphRewrite"]
