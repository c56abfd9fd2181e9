"""The chaos harness (``python -m piwf.chaos``): ``harness`` drives the host while killing it;
``people`` and ``controllers`` add the people in the loop and the controllers; ``ledger`` is
the outside world their effects write to."""
