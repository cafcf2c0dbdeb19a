// The canvas's measures (pixels) and the colours of the three kinds of link.
//   GAP: between tiles of a node; PAD: a node box's inner margin; HEAD: a node box's header; NODE_GAP: between node
//   boxes; HULL: how far a stage's outline stands off its tiles; LANE: the free lane below the nodes (labels).

export const SVG = "http://www.w3.org/2000/svg";
export const GAP = 16, PAD = 12, HEAD = 34, NODE_GAP = 36, HULL = 5, LANE = 26;
export const LINK = { intra: "#159a8c", inter: "#d1495b", mixed: "#7b4fb0" };
// The ZeRO levels the toolbar offers (SPEC §15), each with what it shards beyond the one before.
export const ZERO_LEVELS = [[0, "none"], [1, "optimizer states"], [2, "+ gradients"], [3, "+ weights"]];
