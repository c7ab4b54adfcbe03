// Long tables (the coverage page's per-op and per-overload tables: hundreds of rows) get a
// filter box and sortable columns, and scroll inside a box of their own with the header
// in view, instead of making the page a hundred thousand pixels tall.

var LONG_TABLE_ROWS = 30;

// A row matches a query when it contains every word of the query (case-insensitive).
function rowMatches(rowText, query) {
  var text = rowText.toLowerCase();
  return query.toLowerCase().split(/\s+/).filter(Boolean).every(function (word) {
    return text.indexOf(word) !== -1;
  });
}

// Cells compare as numbers when both read as numbers ("97%", "12", "-"), else as text.
function compareCells(a, b) {
  var number = function (s) {
    var t = s.trim().replace(/%$/, "");
    return t !== "" && !isNaN(Number(t)) ? Number(t) : null;
  };
  var x = number(a), y = number(b);
  if (x !== null && y !== null) {
    return x - y;
  }
  return a.trim().localeCompare(b.trim(), undefined, { numeric: true, sensitivity: "base" });
}

function enhanceTable(table) {
  var body = table.tBodies[0];
  var rows = Array.prototype.slice.call(body.rows);
  table.setAttribute("data-functx-long", "");  // not a class: Material styles class-less tables
  var box = document.createElement("div");
  box.className = "functx-table-filter";
  var input = document.createElement("input");
  input.type = "search";
  input.placeholder = "Filter the " + rows.length + " rows (every word must appear: an op name, 'fallback', 'FAIL')";
  input.setAttribute("aria-label", "Filter the table's rows");
  var count = document.createElement("span");
  box.appendChild(input);
  box.appendChild(count);
  var wrapper = table.closest(".md-typeset__scrollwrap") || table;
  wrapper.parentNode.insertBefore(box, wrapper);
  wrapper.classList.add("functx-table-scroll");
  input.addEventListener("input", function () {
    var shown = 0;
    rows.forEach(function (row) {
      var keep = rowMatches(row.textContent, input.value);
      row.style.display = keep ? "" : "none";
      shown += keep ? 1 : 0;
    });
    count.textContent = input.value ? shown + " of " + rows.length + " rows" : "";
  });
  Array.prototype.forEach.call(table.tHead.rows[0].cells, function (header, column) {
    header.classList.add("functx-sortable");
    header.title = "Sort by this column";
    header.addEventListener("click", function () {
      var ascending = header.getAttribute("aria-sort") !== "ascending";
      Array.prototype.forEach.call(table.tHead.rows[0].cells, function (h) { h.removeAttribute("aria-sort"); });
      header.setAttribute("aria-sort", ascending ? "ascending" : "descending");
      rows.slice().sort(function (r, s) {
        var order = compareCells(r.cells[column].textContent, s.cells[column].textContent);
        return ascending ? order : -order;
      }).forEach(function (row) { body.appendChild(row); });
    });
  });
}

function enhanceLongTables() {
  document.querySelectorAll("article table").forEach(function (table) {
    if (table.tHead && table.tBodies.length && table.tBodies[0].rows.length >= LONG_TABLE_ROWS &&
        !table.hasAttribute("data-functx-long")) {
      enhanceTable(table);
    }
  });
}

if (typeof document$ !== "undefined") {
  document$.subscribe(enhanceLongTables);  // Material's page-load observable
}
if (typeof module !== "undefined") {
  module.exports = { rowMatches: rowMatches, compareCells: compareCells };
}
