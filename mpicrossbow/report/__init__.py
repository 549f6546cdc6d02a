"""``crossbow-report``: figures and summaries of finished runs from their ``metrics.h5`` (:mod:`.cli`)."""
