"""Finding SGLang servers at run time: Kubernetes pods selected by labels.

`KubernetesDiscovery` (kubernetes.py) owns the watches and the reconcile; `PodWatch`
(watch.py) lists and watches one selector; `KubeAPI` (kubeapi.py) speaks the REST API;
`pods.py` decides what a pod means; `incluster.py` finds the API from inside a pod.
"""

from gateway.discovery.incluster import in_cluster_settings
from gateway.discovery.kubernetes import KubernetesDiscovery
from gateway.discovery.pods import PodRules, Target, target_of

__all__ = ["KubernetesDiscovery", "PodRules", "Target", "in_cluster_settings", "target_of"]
