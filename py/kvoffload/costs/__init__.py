"""What each path costs on this device: the calibration cache file, the calibrations of the
raw-pointer copy methods and of the page paths, the one rule both choose by, and
method="auto". They measure with kvoffload.meter; the job layer reads them."""

from .auto import Auto
from .cache import CalibrationCacheError
from .calibration import Calibration
from .page_calibration import PageCalibration
from .rule import fastest_within

__all__ = [
    "Auto", "Calibration", "CalibrationCacheError", "PageCalibration", "fastest_within"
]
