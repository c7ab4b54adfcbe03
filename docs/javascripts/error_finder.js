// The error catalogue's finder: paste an error message, get the rows whose catalogued
// message shares the most of its words (placeholders such as <op> left out), best first,
// as links to the rows' anchors (scripts/error_anchors.py gives each row one).

function words(text) {
  return text.replace(/<[^<>]*>/g, " ").toLowerCase().match(/[a-z_][a-z0-9_]+/g) || [];
}

// rows: [{id, text}] -> [{id, score}] best first; a row's score is the number of its
// words found in the message times the fraction they are of its words, so a long message
// matched word for word beats a short one that a few common words match.
function rankRows(message, rows) {
  var said = new Set(words(message));
  return rows
    .map(function (row, order) {
      var own = Array.from(new Set(words(row.text)));
      var found = own.filter(function (w) { return said.has(w); }).length;
      return { id: row.id, score: own.length ? (found * found) / own.length : 0, order: order };
    })
    .filter(function (r) { return r.score > 0; })
    .sort(function (a, b) { return b.score - a.score || a.order - b.order; })
    .map(function (r) { return { id: r.id, score: r.score }; });
}

function addErrorFinder() {
  var anchors = document.querySelectorAll("a.error-row");
  if (!anchors.length || document.querySelector(".error-finder")) {
    return;
  }
  var rows = Array.prototype.map.call(anchors, function (a) {
    return { id: a.id, text: a.closest("td").textContent, cell: a.closest("td") };
  });
  var box = document.createElement("div");
  box.className = "error-finder";
  var input = document.createElement("input");
  input.type = "search";
  input.placeholder = "Paste an error message to find its row";
  input.setAttribute("aria-label", "Find an error by its message");
  var list = document.createElement("ol");
  box.appendChild(input);
  box.appendChild(list);
  var first = document.querySelector("article h2");
  first.parentNode.insertBefore(box, first);
  input.addEventListener("input", function () {
    list.innerHTML = "";
    rankRows(input.value, rows).slice(0, 3).forEach(function (hit) {
      var row = rows.find(function (r) { return r.id === hit.id; });
      var item = document.createElement("li");
      var link = document.createElement("a");
      link.href = "#" + hit.id;
      link.textContent = row.text.replace(/^#\s*/, "").slice(0, 160);
      item.appendChild(link);
      list.appendChild(item);
    });
  });
  input.addEventListener("keydown", function (event) {
    var best = list.querySelector("a");
    if (event.key === "Enter" && best) {
      window.location.hash = best.getAttribute("href");
    }
  });
}

if (typeof document$ !== "undefined") {
  document$.subscribe(addErrorFinder);  // Material's page-load observable
}
if (typeof module !== "undefined") {
  module.exports = { rankRows: rankRows, words: words };
}

// The site's search, given a pasted error message (five words or more), shows the error
// catalogue's best-matching row as its first result: the catalogue page is fetched once
// and its rows ranked as the finder ranks them.
var catalogueRows = null;

function loadCatalogueRows(base) {
  if (!catalogueRows) {
    catalogueRows = fetch(new URL("errors/", base)).then(function (response) {
      return response.text();
    }).then(function (html) {
      var page = new DOMParser().parseFromString(html, "text/html");
      return Array.prototype.map.call(page.querySelectorAll("a.error-row"), function (a) {
        return { id: a.id, text: a.closest("td").textContent.replace(/^#\s*/, "") };
      });
    });
  }
  return catalogueRows;
}

function addErrorHitToSearch() {
  var input = document.querySelector("input.md-search__input");
  var list = document.querySelector(".md-search-result__list");
  var config = document.getElementById("__config");
  if (!input || !list || !config || input.dataset.functxErrors) {
    return;
  }
  input.dataset.functxErrors = "1";
  var base = new URL(JSON.parse(config.textContent).base, window.location.href);
  var place = function () {
    if (words(input.value).length < 5) {
      return;
    }
    var query = input.value;
    loadCatalogueRows(base).then(function (rows) {
      var hits = rankRows(query, rows);
      if (!hits.length || input.value !== query) {
        return;
      }
      var row = rows.find(function (r) { return r.id === hits[0].id; });
      var old = list.querySelector(".functx-error-hit");
      if (old && old === list.firstElementChild && old.dataset.id === row.id) {
        return;
      }
      if (old) {
        old.remove();
      }
      var item = document.createElement("li");
      item.className = "md-search-result__item functx-error-hit";
      item.dataset.id = row.id;
      var link = document.createElement("a");
      link.className = "md-search-result__link";
      link.href = new URL("errors/#" + row.id, base).href;
      var article = document.createElement("article");
      article.className = "md-search-result__article md-typeset";
      var title = document.createElement("h1");
      title.textContent = "Error catalogue: the row of this message";
      var text = document.createElement("p");
      text.textContent = row.text.slice(0, 240);
      article.appendChild(title);
      article.appendChild(text);
      link.appendChild(article);
      item.appendChild(link);
      list.insertBefore(item, list.firstChild);
    });
  };
  new MutationObserver(place).observe(list, { childList: true });
  input.addEventListener("input", place);
}

if (typeof document$ !== "undefined") {
  document$.subscribe(addErrorHitToSearch);
}
