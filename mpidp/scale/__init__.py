"""Scaling: the alpha-beta-gamma cost model (:mod:`~.costmodel`) and ``mpidp model``, which
fits it on this machine (:mod:`~.calibrate`)."""
