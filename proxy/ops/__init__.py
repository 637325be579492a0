"""Operations endpoints: health, readiness, metrics, status, admin (tier,
reload), the live status page, and the client of `brownout reload`."""
