"""Imports every cache policy so that each registers itself in `kvq_lab.cache.policies.POLICIES`.

The one place that knows the plugins: a new policy adds its import here.
"""

from kvq_lab.cache.policies import evict, fakequant, kivi, mikv, saliency  # noqa: F401  (registration)
