"""The routing families, Hopper: routing and slot order in one CTA, the combine and the
row gather (``route_sm90``); the router logits and the routing on many CTAs
(``router_sm90``)."""
