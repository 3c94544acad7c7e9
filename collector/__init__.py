"""rankwatch.collector: correlates heartbeats and bundles across ranks and
names the culprit rank and cause.

    from rankwatch.collector import Collector, CollectorServer, analyze_path
"""

from .offline import AnalyzeError, analyze_path
from .server import CollectorServer
from .service import Collector

__all__ = ["AnalyzeError", "Collector", "CollectorServer", "analyze_path"]
