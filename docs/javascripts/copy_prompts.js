// The copy button of an example written as a Python session (">>> " prompts, "... "
// continuations, printed results) copies the code alone, without prompts or results, so
// that a pasted example runs. Blocks without prompts copy as they are.

function copyableText(text) {
  var lines = text.replace(/\n$/, "").split("\n");
  var isPrompt = function (line) { return /^(>>>|\.\.\.)( |$)/.test(line); };
  if (!lines.some(function (line) { return /^>>>( |$)/.test(line); })) {
    return text;
  }
  return lines.filter(isPrompt).map(function (line) { return line.slice(4); }).join("\n") + "\n";
}

function stripPromptsFromCopyButtons() {
  var buttons = document.querySelectorAll("button[data-clipboard-target]");
  buttons.forEach(function (button) {
    var code = document.querySelector(button.getAttribute("data-clipboard-target"));
    if (code) {
      button.setAttribute("data-clipboard-text", copyableText(code.innerText));
    }
  });
}

if (typeof document$ !== "undefined") {
  document$.subscribe(stripPromptsFromCopyButtons);  // Material's page-load observable
}
if (typeof module !== "undefined") {
  module.exports = { copyableText: copyableText };
}
