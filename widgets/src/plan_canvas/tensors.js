// The tensor picker: which group of the picker (tensors: [[group, [name, ...]], ...]) holds a tensor's name ("" when
// none does).
export function groupOf(groups, name) {
  for (const [g, names] of groups) if (names.includes(name)) return g;
  return "";
}
